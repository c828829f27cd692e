"""One candidate recipe's score on one layer: what `planning.candidates` (a dense FFN) and `planning.moe` (a layer of
routed experts) both report."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CandidateScore", "db"]


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
