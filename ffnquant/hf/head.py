"""The LM head of the engine (`stream.SequentialModel` takes it as a mixin): the final norm and head of the
model's own forward on a batch's last hidden states, its logits (all of them, a vocabulary subset's, or into one kept
buffer) and the loss gradient with respect to those hidden states."""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import torch
from torch import nn

from ..errors import FFNQuantError
from ..infra.blas import bf16_products, fast_linear
from ..infra.device import to_device
from . import replay
from .skeleton import StandIn, beside

__all__ = ["LMHead"]

_CPU = torch.device("cpu")


class LMHead:
    """`SequentialModel`'s head (a mixin: it reads the engine's model, head, embedding, stand-ins and weights)."""

    def head_out(self, hidden: torch.Tensor, vocab: torch.Tensor | None = None,
                 reuse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden state, logits) of one batch's last decoder layer output, from the model's own forward
        (final norm, LM head; onloaded on the first call): what `hf.metrics._run` reads as hidden_states[-1] (the
        base model's last_hidden_state) and logits. `vocab` (token ids): the logits of those tokens only, in that
        order, from the LM head's rows of them (what the model does to its logits after the head, such as a soft
        cap, is elementwise): a fraction of the cost at a large vocabulary. `reuse`: the fast head's logits written
        into one buffer the engine keeps (`release_logits` frees it), valid until the next such call: for a caller
        that reads each batch's logits before the next."""
        with torch.no_grad():
            if vocab is None:
                return self._head(hidden, reuse)
            if replay.is_trail(hidden):  # the model's own forward again: the whole head, those tokens' logits
                final, logits = self._head(hidden)
                return final, logits[..., vocab]
            if self.head.weight.is_meta:
                self._head(hidden[:, :1])  # onloads the head
            weight, bias = self.head.weight, getattr(self.head, "bias", None)
            try:
                self.head.weight = torch.nn.Parameter(weight[vocab], requires_grad=False)
                if isinstance(bias, torch.Tensor):
                    self.head.bias = torch.nn.Parameter(bias[vocab], requires_grad=False)
                final, logits = self._head(hidden)
            finally:
                self.head.weight = weight
                if isinstance(bias, torch.Tensor):
                    self.head.bias = bias
            if logits.shape[-1] != vocab.numel():  # a head that is not one Linear of these rows: the whole one
                final, logits = self._head(hidden)
                logits = logits[..., vocab]
            return final, logits

    def head_grad(self, hidden: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor]):
        """`head_out` of one batch with the gradient of `loss(logits)` (a scalar) with respect to `hidden`:
        (final hidden state, logits, gradient), all detached. The logits in float32; the gradient's products in bf16
        where this CPU has them (`infra.blas.bf16_products`): it only weighs the candidates' errors."""
        if replay.is_trail(hidden):
            raise FFNQuantError(f"{self.info.path}: its forward computes between its decoder layers (beyond what they "
                                "compute), through which the loss gradient at the last layer's output would have to "
                                "be taken again for every layer; the plan's search weighs candidates by it")
        x = hidden.detach().requires_grad_(True)
        with torch.enable_grad():
            final, logits = self._head(x)
            value = loss(logits)
            with bf16_products():
                (grad,) = torch.autograd.grad(value, [x])
        return final.detach(), logits.detach(), grad

    def release_logits(self) -> None:
        """Free the buffer `head_out(reuse=True)` writes the logits into."""
        self._logits = None

    def _logits_into(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A [shape] view of the kept logits buffer (the engine's dtype), grown when a batch needs more."""
        n = math.prod(shape)
        if self._logits is None or self._logits.numel() < n:
            self._logits = None  # the old one freed before the new one is taken
            self._logits = torch.empty(n, dtype=self.dtype, device=self.device)
        return self._logits[:n].view(shape)

    def _embeds_shape(self, hidden: torch.Tensor) -> tuple[int, ...]:
        """[batch, tokens, the token embedding's width] of the ids that gave hidden states of `hidden`'s shape."""
        ids_shape = self._ids_shapes.get(tuple(hidden.shape), tuple(hidden.shape[:2]))
        return (*ids_shape, getattr(self.embedding, "embedding_dim", hidden.shape[-1]))

    def _head(self, hidden: torch.Tensor, reuse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden state, logits) in host memory, computed on the engine's device (a gradient flows back to a
        host `hidden` through the move); `reuse`: see `head_out`."""
        hidden = to_device(hidden, self.device)
        if self.head.weight.is_meta:
            self.onload(self.embedding if self.tied else self.head)
            self.head.weight = self.embedding.weight if self.tied else self.head.weight
        bias = getattr(self.head, "bias", None)
        if isinstance(bias, torch.Tensor) and bias.is_meta:  # a tied head's own bias (ELECTRA's generator head)
            full = f"{self._names[id(self.head)]}.bias"
            self.head.bias = nn.Parameter(self._read_stored(full), requires_grad=False)
        # the forward's other parts (ELECTRA's embedding projection and the dense + norm before its head)
        for module in beside(self.model, self.blocks):
            if module not in (self.embedding, self.head) and any(p.is_meta for p in module.parameters()):
                self.onload(module, skip=[m for m in module.modules() if m is self.embedding or m is self.head])
        got: list[torch.Tensor] = []
        n = len(self.layers)
        # the final hidden state is the causal LM's base model's output, as `hf.metrics._run` reads it from a whole
        # model: the module running the layers may be another (BLT's local encoder; its base model's output is its
        # local decoder's)
        # (OPT's causal LM calls its decoder, the runner, without its base model: the runner's output then)
        base = getattr(self.model, "base_model", None)
        outer: list[torch.Tensor] = []

        def keep(into: list) -> Any:
            return lambda module, args, out: into.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)

        handles = [self.base.register_forward_hook(keep(got))]
        if isinstance(base, nn.Module) and base is not self.model and base is not self.base:
            handles.append(base.register_forward_hook(keep(outer)))
        try:
            with self._stand_ins([StandIn(None, hidden if i == 0 else None, as_tuple=self._tuple_out)
                                  for i in range(n)]), (fast_linear(self.head, self._logits_into if reuse else None)
                                                        if self.fast_head else contextlib.nullcontext()):
                # inputs_embeds only give the forward its shapes, [batch, tokens, the token embedding's width]
                # (ELECTRA's is narrower, DeepSeek-V4's hidden states have a hyper-connection axis): the first
                # stand-in returns `hidden`; a forward without inputs_embeds (CPM-Ant's) takes token ids
                # [batch, tokens] of the ids that gave hidden states of this shape (ProphetNet's hold three streams
                # of positions, Gemma 3n's its AltUp inputs ahead of the batch)
                if replay.is_trail(hidden):  # computes between its layers: its own forward, every layer answering
                    logits = replay.head(self, hidden)
                elif self._takes_embeds:
                    embeds = hidden.new_zeros(self._embeds_shape(hidden))
                    logits = self.model(inputs_embeds=embeds, use_cache=False).logits
                else:
                    shape = self._embeds_shape(hidden)
                    if self.embedding.weight.is_meta:
                        self.onload(self.embedding)
                    ids = torch.zeros(shape[:2], dtype=torch.long, device=hidden.device)
                    logits = self.model(input_ids=ids, use_cache=False).logits
        finally:
            for handle in handles:
                handle.remove()
        return to_device(outer[-1] if outer else got[0], _CPU), to_device(logits, _CPU)  # in host memory
