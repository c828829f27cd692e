"""One candidate recipe's score on one layer: what `planning.candidates` (a dense FFN) and `planning.moe` (a layer of
routed experts) both report, and the rows both score on."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from ..errors import FFNQuantError
from ..numerics.accuracy import HELD_ROWS, held_rows  # noqa: F401  (re-exported: the rows candidates score on)

__all__ = ["CandidateScore", "HELD_ROWS", "SCORE_ROWS", "db", "held_rows", "scored_rows"]


# Search rows each candidate's output error (raw and gradient-weighted) is summed over: the rows of the search text's
# leading sequences that the loss gradients cover (`planning.source` takes them on the leading whole batches holding
# this many tokens), evenly strided when they are more. Its per-token mean is what the prediction reads (times a
# per-layer factor fitted on 512 probe tokens, which bounds the prediction's precision more than 2,048 rows do).
SCORE_ROWS = 2048


def scored_rows(calib: Any, grad: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """The search rows a candidate's output error is summed over, and their loss gradients: the leading rows the
    gradients cover, evenly strided to at most `SCORE_ROWS` (an MoE layer's routed tokens: the leading ones)."""
    n = grad.shape[0]
    if grad.shape[1:] != calib.shape[1:] or n > calib.shape[0]:
        raise FFNQuantError(f"{tuple(grad.shape)} gradients for {tuple(calib.shape)} search inputs")
    if not isinstance(calib, torch.Tensor):
        return calib[:n], grad
    return held_rows(calib[:n], SCORE_ROWS), held_rows(grad, SCORE_ROWS)


@dataclass
class CandidateScore:
    """One recipe on one layer: its held-out SQNR, its output error on the search tokens (raw, as SQNR, and weighted
    by the squared loss gradient), its stored bytes; `error` when it could not be applied."""

    recipe: str
    layer_sqnr_db: float | None = None
    search_noise: float | None = None  # sum of squared output errors on the search tokens
    search_sqnr_db: float | None = None  # the layer's output SQNR on the search tokens (its own calibration data)
    fisher: float | None = None  # the same weighted by the squared loss gradient
    bytes: int | None = None
    error: str | None = None
    search_rows: int | None = None  # the search tokens `search_noise` and `fisher` sum over (None: all of them)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def db(signal: float, noise: float) -> float:
    """10 log10(signal / noise), bounded to [-200, 200] dB."""
    return 200.0 if noise <= 0 else (-200.0 if signal <= 0 else min(200.0, 10 * math.log10(signal / noise)))
