"""What a user of a whole model notices, streamed over evaluation batches: next-token perplexity (causal LMs)
and the SQNR/cosine of the final hidden states against a reference run. `hf.evaluate` measures quantized FFNs
put back into the model with these; `compare_models` measures any other candidate (a deployed folder loaded
back, an ONNX graph) on the same batches.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from .arch import ModelKind
from .capture import shift_right
from .checkpoint import ModelInfo

__all__ = ["ErrorStats", "SQNR_CAP_DB", "compare_models"]

SQNR_CAP_DB = 200.0  # as ffnquant.accuracy: identical outputs read as 200 dB, not +inf


class ErrorStats:
    """Streaming SQNR and cosine of `got` against `ref` over the concatenation of all updates."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.dot = 0.0
        self.got_sq = 0.0
        self.n_tokens = 0

    def update(self, ref: torch.Tensor, got: torch.Tensor) -> "ErrorStats":
        r, g = ref.detach().double(), got.detach().double()
        self.signal += float((r * r).sum())
        self.noise += float(((r - g) ** 2).sum())
        self.dot += float((r * g).sum())
        self.got_sq += float((g * g).sum())
        self.n_tokens += r.numel() // max(1, r.shape[-1])
        return self

    @property
    def sqnr_db(self) -> float | None:
        if self.n_tokens == 0:
            return None
        if self.noise == 0.0:
            return SQNR_CAP_DB
        if self.signal == 0.0:
            return -SQNR_CAP_DB
        return min(SQNR_CAP_DB, 10.0 * math.log10(self.signal / self.noise))

    @property
    def cosine(self) -> float | None:
        if self.n_tokens == 0:
            return None
        den = math.sqrt(self.signal * self.got_sq)
        return self.dot / den if den > 0 else (1.0 if self.noise == 0 else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"sqnr_db": self.sqnr_db, "cosine": self.cosine, "n_tokens": self.n_tokens}


class _NLL:
    """Streaming negative log-likelihood of next-token prediction."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, logits: torch.Tensor, ids: torch.Tensor) -> None:
        logits = logits[:, :-1].reshape(-1, logits.shape[-1]).double()
        self.total += float(F.cross_entropy(logits, ids[:, 1:].reshape(-1), reduction="sum"))
        self.count += ids[:, 1:].numel()

    @property
    def perplexity(self) -> float | None:
        return math.exp(self.total / self.count) if self.count else None


def _final_hidden(info: ModelInfo, out: Any) -> torch.Tensor:
    if info.kind is ModelKind.ENCODER:
        return out.last_hidden_state
    if info.kind is ModelKind.SEQ2SEQ:
        return out.decoder_hidden_states[-1]
    return out.hidden_states[-1]


def _run(model, info: ModelInfo, ids: torch.Tensor):
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if info.kind is ModelKind.SEQ2SEQ:
        inputs["decoder_input_ids"] = shift_right(model, ids)
    with torch.no_grad():
        return model(**inputs, output_hidden_states=True)


def compare_models(reference: Any, candidate: Any, info: ModelInfo, evals: Sequence[torch.Tensor],
                   candidate_run: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None) -> dict[str, Any]:
    """`end_to_end`'s figures for a whole other model (a deployed folder loaded back, an ONNX graph): the final
    hidden state's SQNR/cosine against `reference` and, for causal LMs, both perplexities on `evals`.

    `candidate_run(ids) -> (logits, final hidden)` runs a candidate that is not a transformers model
    (`candidate` is then unused)."""
    hidden, nll_ref, nll = ErrorStats(), _NLL(), _NLL()
    causal = info.kind is ModelKind.CAUSAL_LM
    for ids in evals:
        ref = _run(reference, info, ids)
        if candidate_run is not None:
            logits, final = candidate_run(ids)
        else:
            out = _run(candidate, info, ids)
            logits, final = out.logits, _final_hidden(info, out)
        hidden.update(_final_hidden(info, ref), final)
        if causal:
            nll_ref.update(ref.logits, ids)
            nll.update(logits, ids)
    out = {"hidden_sqnr_db": hidden.sqnr_db, "hidden_cosine": hidden.cosine,
           "n_tokens": sum(int(b.numel()) for b in evals)}
    if causal:
        out.update(baseline_perplexity=nll_ref.perplexity, perplexity=nll.perplexity,
                   perplexity_ratio=nll.perplexity / nll_ref.perplexity)
    return out
