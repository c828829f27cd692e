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

__all__ = ["sqnr_db", "cosine", "rel_l2", "max_abs_error", "Accuracy", "accuracy_of", "run_batched", "HELD_ROWS",
           "held_rows"]

# Held-out rows a layer's candidates are scored on (its held-out SQNR, and onnxruntime's floor beside it): evenly
# strided over the held-out text, so every domain and every position in a sequence (the first token's massive
# activations included) stays represented. Measured on SmolLM2-135M's layers 5 and 20 (four recipes, against all
# 8,192 held-out rows): 2,048 rows within 0.27 dB, 1,024 rows within 0.27 dB (static int8, whose error the few
# largest rows carry; 0.05 dB for the others): half the rows, no less settled. The prediction's per-layer factor
# comes from 512 probe tokens, and the end-to-end verification runs on the whole held-out text.
HELD_ROWS = 1024


def held_rows(x: torch.Tensor, limit: int = HELD_ROWS) -> torch.Tensor:
    """At most `limit` rows of `x`, evenly strided from the first (all of them when there are no more)."""
    if x.shape[0] <= limit:
        return x
    stride = -(-x.shape[0] // limit)  # ceil: at most `limit` rows
    return x[::stride].contiguous()


# Outputs equal to float precision read as this many dB rather than +inf (JSON has no inf).
SQNR_CAP_DB = 200.0


def _flat(x: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x) if not isinstance(x, torch.Tensor) else x).detach().reshape(-1)


@dataclass(frozen=True)
class _Sums:
    """The float64 sums every figure is made of: ||ref||^2, ||got||^2, <ref, got>, ||ref - got||^2, max |ref - got|."""

    signal: float
    got_sq: float
    dot: float
    noise: float
    max_err: float


def _sums(ref: Any, got: Any) -> _Sums:
    """The sums in float64 (`vector_norm` accumulates float32 values in float64 without a float64 copy).

    A finite float32/float64 value squared stays finite in float64, so the sums are finite exactly when every
    value is: the non-finite check costs nothing beyond the sums. The inner product comes from the polarization
    identity <r, g> = (|r|^2 + |g|^2 - |r - g|^2) / 2."""
    r, g = _flat(ref), _flat(got)
    if r.shape != g.shape:
        raise FFNQuantError(f"reference and quantized outputs differ in size: {r.numel()} vs {g.numel()}")
    if r.dtype != g.dtype:
        r, g = r.double(), g.double()
    f64 = torch.float64
    signal = float(torch.linalg.vector_norm(r, dtype=f64)) ** 2
    got_sq = float(torch.linalg.vector_norm(g, dtype=f64)) ** 2
    if not (math.isfinite(signal) and math.isfinite(got_sq)):
        raise FFNQuantError("non-finite values in the outputs being compared")
    diff = r - g
    noise = float(torch.linalg.vector_norm(diff, dtype=f64)) ** 2
    if not math.isfinite(noise):  # finite values whose difference overflows their own dtype
        diff = r.double() - g.double()
        noise = float(torch.linalg.vector_norm(diff)) ** 2
    max_err = float(diff.abs().max()) if diff.numel() else 0.0
    return _Sums(signal, got_sq, (signal + got_sq - noise) / 2, noise, max_err)


def _sqnr(s: _Sums) -> float:
    if s.noise == 0.0:
        return SQNR_CAP_DB
    if s.signal == 0.0:
        return -SQNR_CAP_DB
    return min(SQNR_CAP_DB, 10.0 * math.log10(s.signal / s.noise))


def _cosine(s: _Sums) -> float:
    den = math.sqrt(s.signal) * math.sqrt(s.got_sq)
    return max(-1.0, min(1.0, s.dot / den)) if den > 0 else (1.0 if s.noise == 0 else 0.0)


def _rel_l2(s: _Sums) -> float:
    # an all-zero reference (an FFN whose output matrix is zero: xLSTM's initialisation) has no relative error: none
    # where the outputs agree, an infinite one where they do not (`Accuracy.to_dict` writes that as null)
    if s.signal > 0:
        return math.sqrt(s.noise) / math.sqrt(s.signal)
    return 0.0 if s.noise == 0.0 else math.inf


def sqnr_db(ref: Any, got: Any) -> float:
    """20 log10(||ref|| / ||ref - got||), capped at 200 dB for identical outputs."""
    return _sqnr(_sums(ref, got))


def cosine(ref: Any, got: Any) -> float:
    """Cosine similarity of the flattened outputs."""
    return _cosine(_sums(ref, got))


def rel_l2(ref: Any, got: Any) -> float:
    """||ref - got|| / ||ref||."""
    return _rel_l2(_sums(ref, got))


def max_abs_error(ref: Any, got: Any) -> float:
    return _sums(ref, got).max_err


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
            "rel_l2": self.rel_l2 if math.isfinite(self.rel_l2) else None,  # JSON has no infinity
            "max_abs_error": self.max_abs_error,
            "n_tokens": self.n_tokens,
        }


def accuracy_of(ref: Any, got: Any, n_tokens: int | None = None) -> Accuracy:
    """All four figures for two output arrays (torch or numpy)."""
    r = torch.as_tensor(np.asarray(ref)) if not isinstance(ref, torch.Tensor) else ref
    n = int(n_tokens if n_tokens is not None else (r.reshape(-1, r.shape[-1]).shape[0] if r.ndim else 1))
    sums = _sums(ref, got)  # one pass for all four figures
    return Accuracy(_sqnr(sums), _cosine(sums), _rel_l2(sums), sums.max_err, n)


def run_batched(fn: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """fn over [n, d] tokens in batches (bounded memory for wide d_ff), concatenated."""
    with torch.no_grad():
        return torch.cat([fn(tokens[i : i + batch_size]) for i in range(0, tokens.shape[0], batch_size)])

