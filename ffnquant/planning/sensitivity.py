"""What an error in one FFN layer's output costs the model end to end, measured on the search text.

Two measurements, both on the calibration ("search") text, never on the held-out text the plan is verified on
(`planning.source` runs them through the engine, a decoder layer at a time):

- the loss gradients: a forward and backward pass of the float model gives, per layer, the gradient g of the
  summed next-token loss with respect to that FFN's output at every token (`gradient_probe` marks the output).
  To second order the loss a noise dy adds is 1/2 dy^T H dy; with the empirical Fisher (g g^T, diagonal) in
  place of H, a candidate's predicted damage is proportional to sum_t,j g_tj^2 dy_tj^2 (`fisher_noise`). Its
  scale is fitted to measurements:
- the ablations: the model with one layer's FFN replaced, run from that layer on: the measured change of the
  mean negative log-likelihood and the final hidden state's noise for that layer alone (`ablation_terms`).

Plans need a causal LM with one FFN per decoder layer (a module, or Linears in the block itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from ..hf.arch import Install, ModelKind
from ..hf.capture import _module_for
from ..hf.metrics import summed_nll
from ..hf.routed import call_modules

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo

__all__ = ["check_plannable", "fisher_noise", "Ablation", "ablation_terms", "float_terms", "gradient_probe", "noise_per_kl", "probe_vocabulary", "PROBE_TOP_K",
           "predicted_tokens", "probe_batches"]


def check_plannable(info: ModelInfo, objective: Any = None) -> None:
    """Raise FFNQuantError unless plans support this model: a causal LM with one FFN per decoder layer (a module,
    or Linears in the block itself), or layers of routed experts held as transformers' fused expert tensors
    (planned a layer at a time: every expert of a layer under one recipe). The latency objective times one FFN
    at the model's shape, which a layer of routed experts is not: those plan by bytes."""
    if info.kind is not ModelKind.CAUSAL_LM:
        raise FFNQuantError(f"plan: {info.model_type} is {info.kind}: plans need a causal LM (their promise is its "
                            "perplexity); per-recipe evaluation of this model: ffnquant model eval")
    if info.arch.install is Install.EXPERTS or info.n_experts:
        if not info.arch.fused_expert_roles:
            raise FFNQuantError(f"plan: {info.model_type}'s experts are separate modules, not transformers' fused "
                                "expert tensors, which plans of routed experts read; per-recipe evaluation of this "
                                "model: ffnquant model eval")
        if objective is not None and getattr(objective, "kind", None) == "latency":
            raise FFNQuantError(f"plan: {info.model_type} routes each token to some of its experts: the latency "
                                "objective times one FFN at the model's shape, not a layer of routed experts; use "
                                "--objective bytes")


def _ffn_names(model: nn.Module, info: ModelInfo, layers: Sequence[Any]) -> dict[int, str]:
    """Each layer's FFN module name in the loaded model."""
    names = [n for n, _ in model.named_modules()]
    return {layer.index: _module_for(model, info, layer, names)[0] for layer in layers}


def _ffn_modules(model: nn.Module, info: ModelInfo, layers: Sequence[Any], inputs: bool = False) -> dict[int, nn.Module]:
    """The module whose output is each layer's FFN output (an FFN of Linears in the block: its second Linear;
    routed experts held as child modules: down's); `inputs`: for routed experts, the one handed their rows."""
    second = info.arch.split_attrs[2] if info.arch.install is Install.SPLIT else ""
    modules = {i: model.get_submodule(f"{name}.{second}" if second else name)
               for i, name in _ffn_names(model, info, layers).items()}
    if info.arch.matrix_experts:  # experts' matrices as child modules: down's module returns each row's output
        modules = {i: call_modules(m, info.arch)[0 if inputs else 1] for i, m in modules.items()}
    return modules


def _nll_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return summed_nll(logits, ids)  # differentiable: the loss of the backward pass


def probe_batches(batches: Sequence[torch.Tensor], probe_tokens: int) -> tuple[list[torch.Tensor], int]:
    """The leading whole sequences of `batches` until `probe_tokens` tokens are reached (what the probes are
    measured on), in their batches (the last one cut to the sequences it needs), and their token count."""
    chosen, n = [], 0
    for ids in batches:
        if n >= probe_tokens:
            break
        part = ids[: -(-(probe_tokens - n) // ids.shape[1])]  # whole sequences: ceil(tokens left / sequence)
        chosen.append(part)
        n += int(part.numel())
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
    change of one layer is dominated by chance (it is often negative), the KL is not. `sequences`: per probe
    sequence, (its summed NLL change, its summed KL): how much the NLL change scatters about the KL, which is
    what the width of a verification round's interval scales with (`noise_per_kl`)."""

    index: int
    kl: float
    nll_delta: float
    hidden_noise: float
    hidden_signal: float
    tokens: int
    sequences: tuple[tuple[float, float], ...] = ()

    @property
    def hidden_nsr(self) -> float:
        return self.hidden_noise / self.hidden_signal if self.hidden_signal > 0 else float("inf")

    @classmethod
    def of(cls, index: int, terms: Sequence[tuple], tokens: int) -> "Ablation":
        """From each batch's `ablation_terms`, summed in batch order; `tokens`: the predicted tokens of them all."""
        kl, nll, noise, signal, seqs = 0.0, 0.0, 0.0, 0.0, []
        for a, b, c, d, *per_sequence in terms:
            kl, nll, noise, signal = kl + a, nll + b, noise + c, signal + d
            seqs += per_sequence[0] if per_sequence else []
        return cls(index, kl / tokens, nll / tokens, noise, signal, tokens, tuple(seqs))


def noise_per_kl(ablations: Iterable[Ablation]) -> float | None:
    """w in Var(a sequence's summed NLL change) ~ w x (its summed KL), pooled over the probes' ablations (None
    without sequences): each sequence's NLL change scattered about its KL (their expectations agree to second
    order). For independent tokens w is about 2 (the per-token variance of the log-likelihood ratio is twice the
    KL for a small change); the tokens of a passage move together, so a measured w is larger. A verification
    round's interval half-width on N held-out tokens is then about t x sqrt(w x KL per token / N)."""
    num = den = 0.0
    for ab in ablations:
        for delta, kl in ab.sequences:
            num += (delta - kl) ** 2
            den += kl
    return num / den if den > 0 else None


# The probes' ablations take the next-token distribution over the float model's PROBE_TOP_K likeliest tokens at every
# probe position and the tokens that come next (`probe_vocabulary`): a few thousand of a vocabulary of up to 262k,
# which hold nearly all of the float model's mass. Their KL (renormalized on those tokens) only fits each layer's
# scale of the prediction; every verification round measures the whole vocabulary.
PROBE_TOP_K = 64


def probe_vocabulary(logits: torch.Tensor, ids: torch.Tensor, k: int = PROBE_TOP_K) -> torch.Tensor:
    """The token ids (sorted) a probe batch's ablations are measured over: the float model's `k` likeliest next
    tokens at every position and the true next tokens."""
    top = logits[:, :-1].topk(min(k, logits.shape[-1]), dim=-1).indices
    return torch.unique(torch.cat([top.reshape(-1), ids[:, 1:].reshape(-1)]))


def float_terms(logits: torch.Tensor, ids: torch.Tensor, vocab: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What an ablation is measured against, of one batch of the float run, per sequence: its summed NLL, its
    next-token probabilities p (float32) and its summed sum(p log p): kept once, each ablation reads them.
    `vocab`: `logits` are over those token ids only (`probe_vocabulary`), which the next tokens `ids` are among."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    p = logp.exp()
    return _target_nll(logp, _positions(ids, vocab)), p, (p * logp).sum(-1).sum(-1, dtype=torch.float64)


def _positions(ids: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """`ids` as positions in the sorted `vocab` (themselves without one)."""
    return ids if vocab is None else torch.searchsorted(vocab, ids)


def _target_nll(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each sequence's summed NLL of its next tokens (float64) under float32 log-probabilities [sequences,
    positions - 1, vocabulary] (the float run's and an ablation's alike, so their difference carries no rounding
    bias of either)."""
    return -logp.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1, dtype=torch.float64)


def ablation_terms(logits: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor, ref_nll: torch.Tensor,
                   ref_p: torch.Tensor, ref_plogp: torch.Tensor, ref_hidden: torch.Tensor,
                   vocab: torch.Tensor | None = None) -> tuple:
    """One batch of a run with a layer replaced, against the float run's (`float_terms`, final hidden state):
    (summed KL of the next-token distribution, NLL change, final hidden noise energy, signal energy, per sequence
    [(NLL change, KL)]).

    KL = sum p log p - sum p log q, the first kept from the float run; the NLL from the same log q. Each term's
    float32 rounding is about 1e-7 of a log-probability, as the elementwise p (log p - log q) had. `vocab`: as in
    `float_terms`, the same tokens."""
    logq = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    kl = ref_plogp - (ref_p * logq).sum(-1).sum(-1, dtype=torch.float64)  # per token in float32, then float64
    nll = _target_nll(logq, _positions(ids, vocab)) - ref_nll
    ref = ref_hidden.double()
    return (float(kl.sum()), float(nll.sum()), float((hidden.double() - ref).square().sum()),
            float(ref.square().sum()), list(zip(nll.tolist(), kl.tolist())))
