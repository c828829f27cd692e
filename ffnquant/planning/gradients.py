"""The plan's second pass over the model (`planning.source.PlanSource`, a mixin of it): the loss gradient at each
FFN's output on the search text's leading batches, which weighs each candidate's output error. Last layer to
first, each layer recomputed on its kept input with the gradient probe at its FFN's output
(`sensitivity.gradient_probe`), the gradient at its output carried back to its input: the operations of one
backward pass through the whole model. A replayed model (`hf.replay`) takes one backward pass of the whole model
per batch, and a model whose forward computes its layers without autograd (Reformer's reversible layers) its own
training backward."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from ..errors import FFNQuantError

__all__ = ["GradientPass"]


@contextlib.contextmanager
def _hooked(module: Any, hook: Callable):
    """`hook` registered as `module`'s forward hook while active."""
    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _training_backward(engine: Any):
    """While active, the engine's decoder layers (not their submodules) are in training mode and its embedding's
    output requires a gradient: what a reversible model's training backward needs to run (`_whole_gradients`)."""
    layers = list(engine.layers)
    was = [layer.training for layer in layers]
    handle = engine.embedding.register_forward_hook(lambda module, args, out: out.detach().requires_grad_())
    for layer in layers:
        layer.training = True
    try:
        yield
    finally:
        handle.remove()
        for layer, mode in zip(layers, was):
            layer.training = mode


def _check_differentiable(info: Any, value: torch.Tensor) -> None:
    """Refuse, naming the cause, a model whose own forward computes without autograd (Reformer's reversible layers
    run under no_grad, their gradients recomputed by a backward only training runs): the plan's loss gradients at
    the FFN outputs cannot be taken from it."""
    if not value.requires_grad:
        raise FFNQuantError(f"{info.path}: its forward computes its decoder layers without autograd (their outputs "
                            "carry no gradient, in evaluation or training mode), so plan cannot take the loss "
                            "gradients it weighs each candidate's error by; quantize --model with a recipe, and "
                            "export with a plan written by hand, do not need them")


class GradientPass:
    """Pass 2 of `PlanSource` (it reads the source's engine, kept layer inputs, calls and probe tokens)."""

    # --- pass 2 -----------------------------------------------------------------------------------------------

    def _backward(self) -> None:
        from ..hf.stream import _host
        from ..infra.blas import bf16_products
        from ..infra.device import to_device
        from .sensitivity import gradient_probe

        m, n = self.model, len(self.model.layers)
        device = m.device  # each batch, its call and its gradient go to the engine's device; what is kept comes back
        self.grads = self._store("ffn-gradient")
        if m.replay:
            self._backward_whole()
            self.grad_out.clear()
            return
        for j in reversed(range(n)):
            block, rows, found = m.layers[j], [], {}
            probe = _hooked(self.outputs[j], gradient_probe(found, j)) if j in self.outputs else contextlib.nullcontext()
            # the gradients only weigh the candidates' errors: their products in bf16 where the CPU has them
            with m.layer(j), probe, torch.enable_grad(), bf16_products():
                for b in range(self.n_grad_batches):
                    args, kwargs = to_device(m._call(j, b, self.block_in[j], self.ccalls), device)
                    # the first layer's input is the embedding, which needs no gradient (nor has one in the
                    # whole model's backward pass)
                    x = self.block_in[j].get(b).to(device).detach().requires_grad_(j > 0)
                    # hidden states by name where the model's loop passes them so (`SequentialModel._hidden_by_name`)
                    out = block(*args, hidden_states=x, **kwargs) if m._hidden_by_name else block(x, *args, **kwargs)
                    out = out[0] if isinstance(out, (tuple, list)) else out  # OpenAI GPT's blocks return a list
                    wrt = ([found[j]] if j in found else []) + ([x] if j > 0 else [])
                    if wrt:
                        _check_differentiable(self.info, out)
                    got = torch.autograd.grad(out, wrt, grad_outputs=self.grad_out.get(b).to(device)) if wrt else ()
                    if j in found:
                        rows.append(_host(got[0].detach().reshape(-1, got[0].shape[-1]).float()))
                    if j > 0:
                        self.grad_out.put(b, _host(got[-1].detach()))
                    found.pop(j, None)
            if rows:
                self.grads.put(j, torch.cat(rows))
            del rows
            self._keep_probe_inputs(j)
            self.progress(f"loss gradients (search text): L{j}", n - j, n)
        self.grad_out.clear()

    def _backward_whole(self) -> None:
        """The loss gradient at every FFN's output from one backward pass of the whole model per batch, every layer
        read: for a model whose forward computes between its layers (`hf.replay`), where the gradient cannot be
        taken back a layer at a time. The probes' inputs are kept as the layer-by-layer pass keeps them."""
        from ..hf.stream import _host

        m, n = self.model, len(self.model.layers)
        rows: dict[int, list[torch.Tensor]] = {j: [] for j in self.outputs}
        with contextlib.ExitStack() as stack:
            for j in range(n):
                stack.enter_context(m.layer(j))
            for b, ids in enumerate(self.calib_ids[: self.n_grad_batches]):
                for j, g in self._whole_gradients(ids.to(m.device)).items():
                    rows[j].append(_host(g.detach().reshape(-1, g.shape[-1]).float()))
                self.progress(f"loss gradients (search text, the whole model): batch {b + 1}", b + 1,
                              self.n_grad_batches)
        for j in range(n):
            if rows.get(j):
                self.grads.put(j, torch.cat(rows[j]))
            self._keep_probe_inputs(j)

    def _whole_gradients(self, ids: torch.Tensor, modes: tuple[bool, ...] = (False, True)) -> dict[int, torch.Tensor]:
        """{layer: the loss gradient at its FFN's output} from one backward pass of the whole model on `ids`. A
        model whose forward computes its layers without autograd (Reformer's reversible layers run under no_grad)
        gives them from its own training backward instead, which recomputes each layer: the decoder layers alone
        in training mode (their submodules, dropout among them, left in eval), the embedding's output made to
        require a gradient, each FFN output's gradient read as its recomputation receives it. `modes`: the
        passes tried in turn (False: evaluation, True: training)."""
        from ..infra.blas import bf16_products
        from .sensitivity import _nll_sum, gradient_probe

        m = self.model
        for training in modes:
            found: dict[int, torch.Tensor] = {}
            with contextlib.ExitStack() as probes, torch.enable_grad(), bf16_products():
                for j, module in self.outputs.items():
                    probes.enter_context(_hooked(module, gradient_probe(found, j)))
                if training:
                    probes.enter_context(_training_backward(m))
                loss = _nll_sum(m.model(input_ids=ids, use_cache=False).logits, ids)
                if not loss.requires_grad and training is not modes[-1]:
                    continue
                _check_differentiable(self.info, loss)
                keys = sorted(found)
                if not training:
                    return dict(zip(keys, torch.autograd.grad(loss, [found[j] for j in keys])))
                loss.backward()
                return {j: found[j].grad for j in keys if found[j].grad is not None}
        return {}

    def _keep_probe_inputs(self, j: int) -> None:
        """Layer j's kept search inputs cut to the probe tokens' (the rows their ablations start from), once its
        gradients are taken."""
        from ..hf import replay

        kept = self._store(f"probe-block{j}")
        for b in range(self.n_probe_batches):
            kept.put(b, self.model.rows(self.block_in[j].get(b), self.probe_ids[b].shape[0]))
            if b in self.block_in[j].calls:  # replayed: the call of the probe's rows, found again from them
                kept.calls[b] = replay.call_at(self.model, kept.get(b))
            if b in self.block_in[j].carried:  # what the previous layer hands this one (`forward.find_carried`)
                handed = self.block_in[j].carried[b]  # None too (XLNet's query stream without a target mapping)
                kept.carried[b] = (self.model.rows(handed, self.probe_ids[b].shape[0])
                                   if isinstance(handed, torch.Tensor) else handed)
        self.block_in[j].clear()
        self.block_in[j] = kept
