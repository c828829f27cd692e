"""`StreamingHistogram`: a fixed-size, mergeable histogram of a tensor site's values.

It keeps a fixed number of bins over a symmetric range [-R, R) where R is always a power of two:
the smallest one strictly above every |value| seen. When data fall outside, R doubles and adjacent
bin pairs fold into one, which is exact because the bin grids nest. Hence the histogram depends only
on the multiset of values, never on batching or order: merging two histograms equals the histogram
of the concatenated data, bin for bin. The observers (`ffnquant.numerics.observe`) and the calibrators
(`ffnquant.numerics.calibrate`) read it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import torch

from ..errors import FFNQuantError

__all__ = ["DEFAULT_BINS", "Workspace", "StreamingHistogram", "as_float_tensor", "non_finite_error"]

DEFAULT_BINS = 2048
# Smallest histogram range 2**_MIN_EXP; the rule "R = max(2**_MIN_EXP, smallest power of two
# above absmax)" depends only on the data's absmax, which is what makes merging exact.
_MIN_EXP = -64


def as_float_tensor(x: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A detached float32 tensor of observed values (numpy and integer inputs accepted; others refused)."""
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(x))
    if not isinstance(x, torch.Tensor):
        raise FFNQuantError(f"expected a tensor or numpy array, got {type(x).__name__}")
    x = x.detach()
    if x.dtype != torch.float32:
        if not (x.is_floating_point() or x.dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)):
            raise FFNQuantError(f"cannot observe a tensor of dtype {x.dtype}")
        # float64 input loses nothing that matters for ranges; fp16/bf16 widen exactly.
        x = x.to(torch.float32)
    return x


def non_finite_error(x: torch.Tensor, what: str) -> FFNQuantError:
    """The one-line error for NaN/Inf among observed values, with their counts."""
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    return FFNQuantError(f"{what} has {n_nan} NaN and {n_inf} Inf values among {x.numel()}")


class Workspace:
    """Reusable scratch buffers for batch statistics (sized by the batch, never by tokens seen).

    Fresh multi-megabyte temporaries are returned to the OS and page-faulted in again on
    every batch, which cost more than the arithmetic itself on the CPUs measured; reusing
    buffers removes that. Not part of any observer's state.
    """

    __slots__ = ("_buffers",)

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> torch.Tensor:
        """A scratch tensor of `shape` on `device` (the device of the data it is written from)."""
        numel = math.prod(shape)
        key = (name, dtype, torch.device(device))
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class StreamingHistogram:
    """Fixed-size, mergeable histogram of signed values over [-R, R), R a power of two.

    `n_bins` must be a multiple of 4 (so doubling R maps bin pairs onto the middle half).
    An empty histogram has no range yet (`edges` is then all zeros).
    """

    __slots__ = ("n_bins", "counts", "_exp")

    def __init__(self, n_bins: int = DEFAULT_BINS) -> None:
        if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 8 or n_bins % 4:
            raise FFNQuantError(f"histogram bins must be an integer multiple of 4, at least 8; got {n_bins!r}")
        self.n_bins = n_bins
        self.counts = np.zeros(n_bins, dtype=np.int64)
        self._exp: int | None = None  # R = 2**_exp; None until a value has been seen

    # --- geometry ----------------------------------------------------------------------
    @property
    def range_max(self) -> float:
        """R: the histogram covers [-R, R); 0.0 while empty."""
        return 0.0 if self._exp is None else math.ldexp(1.0, self._exp)

    @property
    def bin_width(self) -> float:
        return 2.0 * self.range_max / self.n_bins

    @property
    def edges(self) -> np.ndarray:
        """[n_bins + 1] bin edges, float64 (exact: R and the width are powers of two)."""
        r = self.range_max
        return np.linspace(-r, r, self.n_bins + 1)

    @property
    def centers(self) -> np.ndarray:
        e = self.edges
        return 0.5 * (e[:-1] + e[1:])

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    @staticmethod
    def exponent_for(absmax: float) -> int:
        """The smallest e with 2**e > absmax (so every value lies strictly inside [-2**e, 2**e))."""
        # absmax = m * 2**e with 0.5 <= m < 1, hence 2**(e-1) <= absmax < 2**e. The floor at
        # _MIN_EXP (zeros alone, or tiny values) keeps the float32 bin scaling finite.
        if absmax == 0.0:
            return _MIN_EXP
        _, e = math.frexp(absmax)
        return max(e, _MIN_EXP)

    # --- updating ----------------------------------------------------------------------
    def _widen(self, exp: int) -> None:
        """Double R (exp - self._exp) times, folding counts exactly."""
        if self._exp is None:
            self._exp = exp
            return
        k = exp - self._exp
        if k <= 0:
            return
        half = self.n_bins // 2
        i = np.arange(self.n_bins) - half
        # Folding k times maps bin i to half + floor((i - half) / 2**k) (composition of floors).
        target = half + np.floor_divide(i, 2 ** min(k, 62))
        folded = np.zeros_like(self.counts)
        np.add.at(folded, target, self.counts)
        self.counts = folded
        self._exp = exp

    def update(
        self, x: torch.Tensor | np.ndarray, absmax: float | None = None, workspace: Workspace | None = None
    ) -> "StreamingHistogram":
        """Add the values of `x` (any shape); `absmax` may be passed when already known."""
        x = as_float_tensor(x).reshape(-1)
        if x.numel() == 0:
            return self
        if absmax is None:
            lo, hi = torch.aminmax(x)
            absmax = max(-float(lo), float(hi))
        if not math.isfinite(absmax):
            raise non_finite_error(x, "histogram input")
        self._widen(self.exponent_for(absmax))
        half = self.n_bins // 2
        # Scaling by a power of two and flooring are exact, so bin assignment never rounds
        # across an edge; the integer offset is added after the floor for the same reason.
        inv_width = math.ldexp(1.0, -self._exp) * half
        ws = workspace if workspace is not None else Workspace()
        scaled = torch.mul(x, inv_width, out=ws.get("hist_f", tuple(x.shape), device=x.device))
        # floor(y) is an integer with |floor(y)| <= half < 2**24, so adding half is exact in float32.
        scaled.floor_().add_(half)
        idx = ws.get("hist_i", tuple(x.shape), torch.int32, device=x.device)
        idx.copy_(scaled)
        self.counts += torch.bincount(idx, minlength=self.n_bins).cpu().numpy()
        return self

    def merge(self, other: "StreamingHistogram") -> "StreamingHistogram":
        """A new histogram of both inputs' data (equal to the histogram of their concatenation)."""
        if not isinstance(other, StreamingHistogram) or other.n_bins != self.n_bins:
            raise FFNQuantError(
                f"can only merge histograms with the same number of bins ({self.n_bins} vs "
                f"{getattr(other, 'n_bins', type(other).__name__)})"
            )
        out = self.copy()
        if other._exp is None:
            return out
        mine = out
        theirs = other.copy()
        target = max(e for e in (mine._exp, theirs._exp) if e is not None)
        mine._widen(target)
        theirs._widen(target)
        mine.counts = mine.counts + theirs.counts
        return mine

    def copy(self) -> "StreamingHistogram":
        out = StreamingHistogram(self.n_bins)
        out.counts = self.counts.copy()
        out._exp = self._exp
        return out

    # --- reading -----------------------------------------------------------------------
    def abs_counts(self) -> np.ndarray:
        """[n_bins/2] counts of |x| over [k w, (k+1) w), k = 0.. (negative bins mirrored)."""
        half = self.n_bins // 2
        return self.counts[half:] + self.counts[:half][::-1]

    def abs_quantile(self, q: float) -> float:
        """The q-quantile (0..1) of |x|, linearly interpolated inside its bin; within one bin width."""
        if not 0.0 <= q <= 1.0:
            raise FFNQuantError(f"quantile must be in [0, 1], got {q}")
        total = self.total
        if total == 0:
            return float("nan")
        counts = self.abs_counts()
        cum = np.cumsum(counts)
        target = q * total
        k = int(np.searchsorted(cum, target, side="left"))
        k = min(k, len(counts) - 1)
        before = cum[k - 1] if k > 0 else 0
        inside = counts[k]
        frac = 0.0 if inside == 0 else (target - before) / inside
        return float((k + min(max(frac, 0.0), 1.0)) * self.bin_width)

    def nbytes(self) -> int:
        """Size of the state (the counts array)."""
        return int(self.counts.nbytes)

    # --- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-able state; counts are stored sparsely as {bin index: count} pairs."""
        nz = np.flatnonzero(self.counts)
        return {
            "n_bins": self.n_bins,
            "range_exp": self._exp,
            "range_max": self.range_max,
            "nonzero_bins": nz.tolist(),
            "nonzero_counts": self.counts[nz].tolist(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StreamingHistogram":
        try:
            out = cls(int(data["n_bins"]))
            exp = data["range_exp"]
            out._exp = None if exp is None else int(exp)
            idx = np.asarray(data["nonzero_bins"], dtype=np.int64)
            vals = np.asarray(data["nonzero_counts"], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as exc:
            raise FFNQuantError(f"malformed histogram state: {exc}") from exc
        if idx.shape != vals.shape or (idx.size and (idx.min() < 0 or idx.max() >= out.n_bins)) or (vals < 0).any():
            raise FFNQuantError("malformed histogram state: bin indices or counts out of range")
        if out._exp is None and vals.sum():
            raise FFNQuantError("malformed histogram state: counts without a range")
        out.counts[idx] = vals
        return out

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, StreamingHistogram)
            and self.n_bins == other.n_bins
            and self._exp == other._exp
            and np.array_equal(self.counts, other.counts)
        )

    def __repr__(self) -> str:
        return f"StreamingHistogram(n_bins={self.n_bins}, range=+-{self.range_max:g}, total={self.total})"
