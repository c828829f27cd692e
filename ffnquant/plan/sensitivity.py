"""What an error in one FFN layer's output costs the model end to end, measured on the search text.

Two measurements, both on the calibration ("search") text, never on the held-out text the plan is verified on:

- `output_gradients`: one forward and backward pass of the float model gives, per layer, the gradient g of the
  summed next-token loss with respect to that FFN's output at every token. To second order the loss a noise
  dy adds is 1/2 dy^T H dy; with the empirical Fisher (g g^T, diagonal) in place of H, a candidate's predicted
  damage is proportional to sum_t,j g_tj^2 dy_tj^2 (`fisher_noise`). Its scale is fitted to measurements:
- `SuffixRunner.ablate`: the model with one layer's FFN replaced, run from that layer on (the float blocks
  before it return their recorded outputs, so a layer near the end costs a fraction of a full pass): the
  measured change of the mean negative log-likelihood and the final hidden state's noise for that layer alone.

Plans need a causal LM whose FFN is one module of each block (Llama, Mistral, Qwen2, Gemma, Phi-3, GPT-2).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import FFNQuantError

__all__ = ["check_plannable", "output_gradients", "fisher_noise", "SuffixRunner", "Ablation", "ablation_terms",
           "float_terms", "gradient_probe", "predicted_tokens", "probe_batches"]


def check_plannable(info: Any) -> None:
    """Raise FFNQuantError unless plans support this model (a causal LM, one FFN module per block)."""
    from ..hf.arch import Install, ModelKind

    if info.kind is not ModelKind.CAUSAL_LM or info.arch.install is Install.EXPERTS or info.n_experts:
        raise FFNQuantError(
            f"plan: {info.model_type} is not supported yet: plans need a causal LM with one FFN per block (a module, "
            "or Linears in the block itself), not mixture-of-experts; per-recipe evaluation of this model: "
            "ffnquant model eval")


def _ffn_names(model: nn.Module, info: Any, layers: Sequence[Any]) -> dict[int, str]:
    """Each layer's FFN module name in the loaded model."""
    from ..hf.capture import _module_for

    names = [n for n, _ in model.named_modules()]
    return {layer.index: _module_for(model, info, layer, names)[0] for layer in layers}


def _ffn_modules(model: nn.Module, info: Any, layers: Sequence[Any]) -> dict[int, nn.Module]:
    """The module whose output is each layer's FFN output (an FFN of Linears in the block: its second Linear)."""
    from ..hf.arch import Install

    second = info.arch.split_attrs[2] if info.arch.install is Install.SPLIT else ""
    return {i: model.get_submodule(f"{name}.{second}" if second else name)
            for i, name in _ffn_names(model, info, layers).items()}


def _block_modules(model: nn.Module, info: Any, layers: Sequence[Any]) -> dict[int, nn.Module]:
    """The decoder block holding each layer's FFN (the FFN module's parent; the block itself for in-block Linears)."""
    from ..hf.arch import Install

    split = info.arch.install is Install.SPLIT
    return {i: model.get_submodule(name if split else name.rsplit(".", 1)[0])
            for i, name in _ffn_names(model, info, layers).items()}


def _nll_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).double(), ids[:, 1:].reshape(-1), reduction="sum")


def output_gradients(model: nn.Module, info: Any, layers: Sequence[Any], batches: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per layer label, d(summed next-token NLL)/d(FFN output) at each token of `batches`: [tokens, d_model],
    tokens in the order `hf.capture` records the FFN inputs (batch by batch, row-major)."""
    ffns = _ffn_modules(model, info, layers)
    by_index = {layer.index: layer for layer in layers}
    grads: dict[str, list[torch.Tensor]] = {layer.label: [] for layer in layers}
    for ids in batches:
        probes: dict[int, torch.Tensor] = {}
        handles = [m.register_forward_hook(gradient_probe(probes, i)) for i, m in ffns.items()]
        try:
            with torch.enable_grad():
                out = model(input_ids=ids)
                loss = _nll_sum(out.logits, ids)
                zs = [probes[i] for i in sorted(probes)]
                gs = torch.autograd.grad(loss, zs)
        finally:
            for h in handles:
                h.remove()
        for i, g in zip(sorted(probes), gs):
            grads[by_index[i].label].append(g.detach().reshape(-1, g.shape[-1]).float())
    return {label: torch.cat(v) for label, v in grads.items()}


def probe_batches(batches: Sequence[torch.Tensor], probe_tokens: int) -> tuple[list[torch.Tensor], int]:
    """The leading whole batches of `batches` until `probe_tokens` tokens are reached (what the probes are
    measured on), and their token count."""
    chosen, n = [], 0
    for ids in batches:
        if n >= probe_tokens:
            break
        chosen.append(ids)
        n += int(ids.numel())
    return chosen, n


def predicted_tokens(batches: Sequence[torch.Tensor]) -> int:
    """The tokens of `batches` whose next token is predicted (all but each sequence's last)."""
    return sum(int(ids[:, 1:].numel()) for ids in batches)


def gradient_probe(found: dict, key: Any) -> Callable:
    """A forward hook adding to a module's output a zero that requires grad, kept as `found[key]`: the loss
    gradient with respect to that zero is the gradient with respect to the output, the graph left intact."""
    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        z = torch.zeros_like(out, requires_grad=True)
        found[key] = z
        return out + z

    return hook


def fisher_noise(grad: torch.Tensor, ref: torch.Tensor, got: torch.Tensor) -> float:
    """sum over tokens and channels of g^2 (got - ref)^2: the diagonal empirical-Fisher estimate of the loss a
    layer's output error adds (up to the factor the plan fits on measured ablations)."""
    d = (got.double() - ref.double())
    return float((grad.double().square() * d.square()).sum())


@dataclass
class Ablation:
    """One layer replaced, the rest float, on the search text: the mean KL divergence of the next-token
    distribution from the float model's and the mean NLL change (nats per token), and the final hidden
    state's noise and signal energy. The KL is what the plan predicts ppl with: on a few hundred tokens the NLL
    change of one layer is dominated by chance (it is often negative), the KL is not."""

    index: int
    kl: float
    nll_delta: float
    hidden_noise: float
    hidden_signal: float
    tokens: int

    @property
    def hidden_nsr(self) -> float:
        return self.hidden_noise / self.hidden_signal if self.hidden_signal > 0 else float("inf")

    @classmethod
    def of(cls, index: int, terms: Sequence[tuple[float, float, float, float]], tokens: int) -> "Ablation":
        """From each batch's `ablation_terms`, summed in batch order; `tokens`: the predicted tokens of them all."""
        kl, nll, noise, signal = 0.0, 0.0, 0.0, 0.0
        for a, b, c, d in terms:
            kl, nll, noise, signal = kl + a, nll + b, noise + c, signal + d
        return cls(index, kl / tokens, nll / tokens, noise, signal, tokens)


def float_terms(logits: torch.Tensor, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    """What an ablation is measured against, of one batch of the float run: its summed NLL and its next-token
    log-probabilities (float32)."""
    return float(_nll_sum(logits, ids)), torch.log_softmax(logits[:, :-1].float(), dim=-1)


def ablation_terms(logits: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor, ref_nll: float,
                   ref_logp: torch.Tensor, ref_hidden: torch.Tensor) -> tuple[float, float, float, float]:
    """One batch of a run with a layer replaced, against the float run's (`float_terms`, final hidden state):
    (summed KL of the next-token distribution, NLL change, final hidden noise energy, signal energy)."""
    logq = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    kl = float((ref_logp.exp() * (ref_logp - logq)).sum(dtype=torch.float64))
    ref = ref_hidden.double()
    return (kl, float(_nll_sum(logits, ids)) - ref_nll, float((hidden.double() - ref).square().sum()),
            float(ref.square().sum()))


class SuffixRunner:
    """Runs the model on fixed batches with one FFN replaced, computing only the blocks from that layer on.

    `record()` runs the float model once, keeping every block's output, the final hidden states and the NLL.
    `ablate(index, ffn)` then replaces the FFN of block `index`; the blocks before it return their recorded
    outputs instead of computing (embedding, rotary tables and masks are still made; they are cheap).
    """

    def __init__(self, model: nn.Module, info: Any, layers: Sequence[Any], batches: Sequence[torch.Tensor]) -> None:
        """`layers`: the LayerInfos of the FFNs that may be ablated; `batches`: token ids [batch, seq]."""
        self.model, self.info, self.batches = model, info, list(batches)
        self.layers = {layer.index: layer for layer in layers}
        self.blocks = _block_modules(model, info, layers)
        self._outputs: list[dict[int, Any]] = []
        self._hidden: list[torch.Tensor] = []
        self._nll: list[float] = []
        self._logp: list[torch.Tensor] = []

    def record(self) -> "SuffixRunner":
        for ids in self.batches:
            kept: dict[int, Any] = {}
            handles = [b.register_forward_hook(lambda m, a, out, i=i: kept.__setitem__(i, _detach(out)))
                       for i, b in self.blocks.items()]
            try:
                with torch.no_grad():
                    out = self.model(input_ids=ids, output_hidden_states=True)
            finally:
                for h in handles:
                    h.remove()
            self._outputs.append(kept)
            self._hidden.append(out.hidden_states[-1].detach())
            nll, logp = float_terms(out.logits, ids)
            self._nll.append(nll)
            self._logp.append(logp)
        return self

    @property
    def tokens(self) -> int:
        return predicted_tokens(self.batches)

    @contextlib.contextmanager
    def _skip_before(self, index: int, batch: int) -> Iterator[None]:
        undo = []
        try:
            for i, block in self.blocks.items():
                if i < index:
                    cached = self._outputs[batch][i]
                    object.__setattr__(block, "forward", lambda *a, _c=cached, **k: _c)
                    undo.append(block)
            yield
        finally:
            for block in undo:
                delattr(block, "forward")

    def ablate(self, index: int, ffn: Callable[[torch.Tensor], torch.Tensor]) -> Ablation:
        """Layer `index`'s FFN replaced by `ffn` (a callable on [tokens, d_model]), measured on the batches."""
        from ..hf.capture import install_ffns

        if not self._outputs:
            self.record()
        terms = []
        layer = self.layers[index]
        for b, ids in enumerate(self.batches):
            with self._skip_before(index, b), install_ffns(self.model, self.info, {layer: ffn}), torch.no_grad():
                out = self.model(input_ids=ids, output_hidden_states=True)
            terms.append(ablation_terms(out.logits, out.hidden_states[-1], ids, self._nll[b], self._logp[b],
                                        self._hidden[b]))
        return Ablation.of(index, terms, self.tokens)


def _detach(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach()
    if isinstance(out, tuple):
        return tuple(_detach(o) for o in out)
    return out
