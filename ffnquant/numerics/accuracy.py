"""Accuracy of a quantized FFN against the fp32 reference on held-out tokens.

SQNR = 20 log10(||ref|| / ||ref - q||) over the whole output (Frobenius norms), cosine
similarity of the flattened outputs, relative L2 (= 10^(-SQNR/20)) and max abs error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..errors import FFNQuantError

__all__ = ["sqnr_db", "cosine", "rel_l2", "max_abs_error", "Accuracy", "accuracy_of", "run_batched"]

# Outputs equal to float precision read as this many dB rather than +inf (JSON has no inf).
SQNR_CAP_DB = 200.0


def _pair(ref: Any, got: Any) -> tuple[torch.Tensor, torch.Tensor]:
    r = torch.as_tensor(np.asarray(ref) if not isinstance(ref, torch.Tensor) else ref).detach().double().reshape(-1)
    g = torch.as_tensor(np.asarray(got) if not isinstance(got, torch.Tensor) else got).detach().double().reshape(-1)
    if r.shape != g.shape:
        raise FFNQuantError(f"reference and quantized outputs differ in size: {r.numel()} vs {g.numel()}")
    if not (torch.isfinite(r).all() and torch.isfinite(g).all()):
        raise FFNQuantError("non-finite values in the outputs being compared")
    return r, g


def sqnr_db(ref: Any, got: Any) -> float:
    """20 log10(||ref|| / ||ref - got||), capped at 200 dB for identical outputs."""
    r, g = _pair(ref, got)
    noise = float(torch.linalg.vector_norm(r - g))
    signal = float(torch.linalg.vector_norm(r))
    if noise == 0.0:
        return SQNR_CAP_DB
    if signal == 0.0:
        return -SQNR_CAP_DB
    return min(SQNR_CAP_DB, 20.0 * math.log10(signal / noise))


def cosine(ref: Any, got: Any) -> float:
    """Cosine similarity of the flattened outputs."""
    r, g = _pair(ref, got)
    den = float(torch.linalg.vector_norm(r) * torch.linalg.vector_norm(g))
    return float(torch.dot(r, g)) / den if den > 0 else (1.0 if float(torch.linalg.vector_norm(r - g)) == 0 else 0.0)


def rel_l2(ref: Any, got: Any) -> float:
    """||ref - got|| / ||ref||."""
    r, g = _pair(ref, got)
    signal = float(torch.linalg.vector_norm(r))
    return float(torch.linalg.vector_norm(r - g)) / signal if signal > 0 else math.inf


def max_abs_error(ref: Any, got: Any) -> float:
    r, g = _pair(ref, got)
    return float((r - g).abs().max())


@dataclass(frozen=True)
class Accuracy:
    """The four error figures of one quantized output against its reference."""

    sqnr_db: float
    cosine: float
    rel_l2: float
    max_abs_error: float
    n_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "sqnr_db": self.sqnr_db,
            "cosine": self.cosine,
            "rel_l2": self.rel_l2,
            "max_abs_error": self.max_abs_error,
            "n_tokens": self.n_tokens,
        }


def accuracy_of(ref: Any, got: Any, n_tokens: int | None = None) -> Accuracy:
    """All four figures for two output arrays (torch or numpy)."""
    r = torch.as_tensor(np.asarray(ref)) if not isinstance(ref, torch.Tensor) else ref
    n = int(n_tokens if n_tokens is not None else (r.reshape(-1, r.shape[-1]).shape[0] if r.ndim else 1))
    return Accuracy(sqnr_db(ref, got), cosine(ref, got), rel_l2(ref, got), max_abs_error(ref, got), n)


def run_batched(fn: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """fn over [n, d] tokens in batches (bounded memory for wide d_ff), concatenated."""
    with torch.no_grad():
        return torch.cat([fn(tokens[i : i + batch_size]) for i in range(0, tokens.shape[0], batch_size)])

