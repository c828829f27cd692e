"""Streaming observers for FFN tensor sites and weights: bounded memory, mergeable, float64 moments.

`TensorObserver` accumulates, per tensor site, exact min/max, per-channel min/max, exact-zero
counts, ever-non-zero channels and the first four central moments (Pebay's pairwise update
formulas in float64, so streaming and merging agree with a one-shot computation), plus the
histogram from which |x| percentiles are read. State size depends on channels and bins only.

`kurtosis` is Pearson's (non-excess) kurtosis m4/m2^2: 3 for a Gaussian; `excess_kurtosis`
subtracts the 3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
import torch

from ..data import TokenSource
from ..errors import FFNQuantError, unknown_choice
from ..model import FFN, build
from ..spec import FFNSpec
from .histogram import DEFAULT_BINS, StreamingHistogram, Workspace, as_float_tensor, non_finite_error

__all__ = [
    "DEFAULT_BINS",
    "PERCENTILES",
    "OUTLIER_KS",
    "TensorObserver",
    "weight_stats",
    "RangeTable",
    "profile",
    "profile_spec",
]

PERCENTILES = (99.0, 99.9, 99.99)
# Thresholds k for "channel absmax > k * median channel absmax" in summaries.
OUTLIER_KS = (3.0, 6.0, 20.0)
_STATE_VERSION = 1
# Elements of a batch `TensorObserver.update` takes at once (16 MB of float32; each scratch buffer that size).
_CHUNK = 1 << 22


# =====================================================================================
# Per-tensor observer
# =====================================================================================


def _combine_moments(a: tuple[int, float, float, float, float], b: tuple[int, float, float, float, float]):
    """Pebay (2008) pairwise update of (n, mean, M2, M3, M4), M_k = sum of (x - mean)^k."""
    na, ma, m2a, m3a, m4a = a
    nb, mb, m2b, m3b, m4b = b
    if na == 0:
        return b
    if nb == 0:
        return a
    n = na + nb
    delta = mb - ma
    d_n = delta / n
    mean = ma + nb * d_n
    m2 = m2a + m2b + delta * d_n * na * nb
    m3 = m3a + m3b + delta * d_n * d_n * na * nb * (na - nb) + 3.0 * d_n * (na * m2b - nb * m2a)
    m4 = (
        m4a
        + m4b
        + delta * d_n * d_n * d_n * na * nb * (na * na - na * nb + nb * nb)
        + 6.0 * d_n * d_n * (na * na * m2b + nb * nb * m2a)
        + 4.0 * d_n * (na * m3b - nb * m3a)
    )
    return n, mean, m2, m3, m4


def _batch_moments(x: torch.Tensor, ws: Workspace) -> tuple[int, float, float, float, float]:
    """(n, mean, M2, M3, M4) of a float32 [rows, channels] tensor.

    Powers are taken about a centre near the mean (the mean of the first rows, so no
    cancellation and no extra pass), summed per row in float32 (short sums) and across rows
    in float64, then shifted exactly to the mean. float64 sums over the whole batch cost
    several times more on CPU for no visible gain.
    """
    n = x.numel()
    rows = x.shape[0]
    centre = x[:64].mean()
    d = torch.sub(x, centre, out=ws.get("d", tuple(x.shape), device=x.device))
    d2 = torch.mul(d, d, out=ws.get("d2", tuple(x.shape), device=x.device))
    t = ws.get("t", tuple(x.shape), device=x.device)
    row_sums = ws.get("rows", (4, rows), device=x.device)
    torch.sum(d, dim=-1, out=row_sums[0])
    torch.sum(d2, dim=-1, out=row_sums[1])
    torch.sum(torch.mul(d2, d, out=t), dim=-1, out=row_sums[2])
    torch.sum(torch.mul(d2, d2, out=t), dim=-1, out=row_sums[3])
    totals = row_sums.to(torch.float64).sum(dim=1)
    s1, s2, s3, s4, c = torch.cat([totals, centre.to(torch.float64).reshape(1)]).tolist()  # one sync
    m = s1 / n
    m2 = s2 - s1 * m
    m3 = s3 - 3.0 * m * s2 + 2.0 * n * m**3
    m4 = s4 - 4.0 * m * s3 + 6.0 * m * m * s2 - 3.0 * n * m**4
    return n, c + m, max(m2, 0.0), m3, max(m4, 0.0)


class TensorObserver:
    """Streaming statistics of one tensor site; `update(x)` takes x of shape (..., channels)."""

    def __init__(self, bins: int = DEFAULT_BINS, name: str = "") -> None:
        self.name = name
        self.histogram = StreamingHistogram(bins)
        self.channels: int | None = None
        self.n_rows = 0
        self._moments: tuple[int, float, float, float, float] = (0, 0.0, 0.0, 0.0, 0.0)
        self.zero_count = 0
        self._cmin: torch.Tensor | None = None  # [channels] float32
        self._cmax: torch.Tensor | None = None
        self._nonzero: torch.Tensor | None = None  # [channels] bool: ever non-zero
        self._workspace: Workspace | None = None  # scratch for update(); not state

    # --- accumulating ------------------------------------------------------------------
    @classmethod
    def of_batch(
        cls, x: torch.Tensor | np.ndarray, bins: int = DEFAULT_BINS, name: str = "", workspace: Workspace | None = None
    ) -> "TensorObserver":
        """An observer of one batch (..., channels); raises on NaN/Inf, naming the site.
        `workspace` lends scratch buffers (pass one to reuse them across batches)."""
        out = cls(bins, name)
        ws = workspace if workspace is not None else Workspace()
        x = as_float_tensor(x)
        if x.ndim == 0:
            x = x.reshape(1, 1)
        channels = x.shape[-1]
        x2 = x.reshape(-1, channels)
        if x2.numel() == 0:
            return out
        # amax/amin over rows are several times faster than aminmax(dim=0) on CPU.
        cmax, cmin = x2.amax(dim=0), x2.amin(dim=0)
        lo, hi = float(cmin.min()), float(cmax.max())
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise non_finite_error(x2, f"site {name or '?'}")
        out.histogram.update(x2, absmax=max(-lo, hi), workspace=ws)
        n, mean, m2, m3, m4 = _batch_moments(x2, ws)
        out._moments = (n, mean, m2, m3, m4)
        out.zero_count = n - int(torch.count_nonzero(x2))
        out.channels = channels
        out.n_rows = x2.shape[0]
        out._cmin, out._cmax = cmin, cmax
        # A channel was non-zero in this batch iff its min or max is.
        out._nonzero = (cmin != 0) | (cmax != 0)
        return out

    def update(self, x: torch.Tensor | np.ndarray) -> "TensorObserver":
        """Fold a batch (..., channels) into the statistics; raises on NaN/Inf or a channel mismatch
        (and then changes nothing). A batch over `_CHUNK` elements is taken `_CHUNK` elements of rows at a time,
        so the scratch buffers stay bounded (a whole weight: five float32 temporaries of its size otherwise)."""
        if self._workspace is None:
            self._workspace = Workspace()
        x = as_float_tensor(x)
        x2 = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
        step = max(1, _CHUNK // max(1, x2.shape[1]))
        if x2.shape[0] <= step:
            return self.absorb(TensorObserver.of_batch(x, self.histogram.n_bins, self.name, self._workspace))
        if self.channels is not None and x2.shape[1] != self.channels:
            raise FFNQuantError(f"site {self.name or '?'}: got {x2.shape[1]} channels, expected {self.channels}")
        part = TensorObserver(self.histogram.n_bins, self.name)  # absorbed whole, so a failed chunk changes nothing
        for i in range(0, x2.shape[0], step):
            part.absorb(TensorObserver.of_batch(x2[i:i + step], self.histogram.n_bins, self.name, self._workspace))
        return self.absorb(part)

    def absorb(self, other: "TensorObserver") -> "TensorObserver":
        """Fold another observer's data into this one, in place (see `merge` for the pure form)."""
        if not isinstance(other, TensorObserver):
            raise FFNQuantError(f"cannot merge a TensorObserver with {type(other).__name__}")
        if self.channels is not None and other.channels is not None and self.channels != other.channels:
            raise FFNQuantError(f"site {self.name or '?'}: got {other.channels} channels, expected {self.channels}")
        if other.channels is None:
            return self
        self.histogram = self.histogram.merge(other.histogram)
        if self.channels is None:
            self.channels = other.channels
            self._cmin, self._cmax, self._nonzero = other._cmin.clone(), other._cmax.clone(), other._nonzero.clone()
        else:
            torch.minimum(self._cmin, other._cmin, out=self._cmin)
            torch.maximum(self._cmax, other._cmax, out=self._cmax)
            self._nonzero |= other._nonzero
        self.n_rows += other.n_rows
        self.zero_count += other.zero_count
        self._moments = _combine_moments(self._moments, other._moments)
        return self

    def copy(self) -> "TensorObserver":
        return TensorObserver(self.histogram.n_bins, self.name).absorb(self)

    def merge(self, other: "TensorObserver") -> "TensorObserver":
        """A new observer holding both observers' data (as if one had seen all of it)."""
        return self.copy().absorb(other)

    # --- statistics --------------------------------------------------------------------
    @property
    def n(self) -> int:
        """Number of elements seen."""
        return self._moments[0]

    @property
    def min(self) -> float:
        return float(self._cmin.min()) if self._cmin is not None else float("nan")

    @property
    def max(self) -> float:
        return float(self._cmax.max()) if self._cmax is not None else float("nan")

    @property
    def absmax(self) -> float:
        return max(-self.min, self.max) if self._cmin is not None else float("nan")

    @property
    def mean(self) -> float:
        return self._moments[1] if self.n else float("nan")

    @property
    def variance(self) -> float:
        """Population variance (divides by n)."""
        return self._moments[2] / self.n if self.n else float("nan")

    @property
    def std(self) -> float:
        return math.sqrt(self.variance) if self.n else float("nan")

    @property
    def skewness(self) -> float:
        n, _, m2, m3, _ = self._moments
        return math.sqrt(n) * m3 / m2**1.5 if n and m2 > 0 else float("nan")

    @property
    def kurtosis(self) -> float:
        """Pearson's kurtosis n*M4/M2^2 (3 for a Gaussian); nan for constant data."""
        n, _, m2, _, m4 = self._moments
        return n * m4 / (m2 * m2) if n and m2 > 0 else float("nan")

    @property
    def excess_kurtosis(self) -> float:
        return self.kurtosis - 3.0

    @property
    def crest_factor(self) -> float:
        """absmax / std: how many standard deviations the largest value lies out."""
        std = self.std
        return self.absmax / std if self.n and std > 0 else float("nan")

    @property
    def zero_fraction(self) -> float:
        """Fraction of elements exactly equal to zero."""
        return self.zero_count / self.n if self.n else float("nan")

    def abs_percentile(self, p: float) -> float:
        """The p-th percentile (0..100) of |x|, from the histogram (within one bin width), capped at absmax."""
        if not 0.0 <= p <= 100.0:
            raise FFNQuantError(f"percentile must be in [0, 100], got {p}")
        return min(self.histogram.abs_quantile(p / 100.0), self.absmax)

    @property
    def percentiles(self) -> dict[str, float]:
        """|x| percentiles 99, 99.9, 99.99 keyed '99', '99.9', '99.99'."""
        return {f"{p:g}": self.abs_percentile(p) for p in PERCENTILES}

    @property
    def channel_min(self) -> np.ndarray:
        return self._channel(self._cmin)

    @property
    def channel_max(self) -> np.ndarray:
        return self._channel(self._cmax)

    @property
    def channel_absmax(self) -> np.ndarray:
        """[channels] float64: max |x| per channel (last dimension)."""
        if self._cmin is None:
            return np.zeros(0)
        return self._channel(torch.maximum(-self._cmin, self._cmax))

    @property
    def channel_ever_nonzero(self) -> np.ndarray:
        """[channels] bool: whether the channel was ever non-zero."""
        return self._nonzero.cpu().numpy().copy() if self._nonzero is not None else np.zeros(0, dtype=bool)

    @property
    def dead_units(self) -> int:
        """Channels that were exactly zero for every token seen (e.g. ReLU units never active)."""
        return int((~self._nonzero).sum()) if self._nonzero is not None else 0

    def outlier_channels(self, k: float = 6.0) -> int:
        """Number of channels whose absmax exceeds k times the median channel absmax."""
        ca = self.channel_absmax
        if ca.size == 0:
            return 0
        return int((ca > k * float(np.median(ca))).sum())

    @staticmethod
    def _channel(t: torch.Tensor | None) -> np.ndarray:
        return t.to(torch.float64).cpu().numpy().copy() if t is not None else np.zeros(0)

    def nbytes(self) -> int:
        """Size of the accumulated state in bytes (independent of how many tokens were seen)."""
        size = self.histogram.nbytes()
        for t in (self._cmin, self._cmax, self._nonzero):
            if t is not None:
                size += t.numel() * t.element_size()
        return size

    def summary(self) -> dict[str, Any]:
        """The scalar statistics as a JSON-able dict (None where undefined, e.g. empty or constant)."""
        ca = self.channel_absmax

        def num(v: float) -> float | None:
            return float(v) if v == v and math.isfinite(v) else None

        return {
            "n": self.n,
            "n_tokens": self.n_rows,
            "channels": self.channels,
            "min": num(self.min),
            "max": num(self.max),
            "absmax": num(self.absmax),
            "mean": num(self.mean),
            "std": num(self.std),
            "skewness": num(self.skewness),
            "kurtosis": num(self.kurtosis),
            "excess_kurtosis": num(self.excess_kurtosis),
            "crest_factor": num(self.crest_factor),
            "abs_percentiles": {k: num(v) for k, v in self.percentiles.items()} if self.n else {},
            "zero_fraction": num(self.zero_fraction),
            "zero_count": self.zero_count,
            "dead_units": self.dead_units,
            "channel_absmax_median": num(float(np.median(ca))) if ca.size else None,
            "channel_absmax_max": num(float(ca.max())) if ca.size else None,
            "outlier_channels": {f"{k:g}": self.outlier_channels(k) for k in OUTLIER_KS},
            "histogram_range": self.histogram.range_max,
            "histogram_bins": self.histogram.n_bins,
        }

    # --- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Full mergeable state (moments, channel arrays, histogram), JSON-able."""
        n, mean, m2, m3, m4 = self._moments
        return {
            "name": self.name,
            "channels": self.channels,
            "n_rows": self.n_rows,
            "zero_count": self.zero_count,
            "moments": {"n": n, "mean": mean, "m2": m2, "m3": m3, "m4": m4},
            "channel_min": self.channel_min.tolist(),
            "channel_max": self.channel_max.tolist(),
            "channel_ever_nonzero": [int(b) for b in self.channel_ever_nonzero],
            "histogram": self.histogram.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TensorObserver":
        try:
            hist = StreamingHistogram.from_dict(data["histogram"])
            out = cls(hist.n_bins, str(data.get("name", "")))
            out.histogram = hist
            mo = data["moments"]
            out._moments = (int(mo["n"]), float(mo["mean"]), float(mo["m2"]), float(mo["m3"]), float(mo["m4"]))
            out.n_rows = int(data["n_rows"])
            out.zero_count = int(data["zero_count"])
            channels = data["channels"]
            if channels is not None:
                out.channels = int(channels)
                out._cmin = torch.tensor(data["channel_min"], dtype=torch.float32)
                out._cmax = torch.tensor(data["channel_max"], dtype=torch.float32)
                out._nonzero = torch.tensor([bool(b) for b in data["channel_ever_nonzero"]], dtype=torch.bool)
                if not (len(out._cmin) == len(out._cmax) == len(out._nonzero) == out.channels):
                    raise ValueError("channel arrays do not match the channel count")
        except (KeyError, TypeError, ValueError) as exc:
            raise FFNQuantError(f"malformed observer state: {exc}") from exc
        return out

    def __repr__(self) -> str:
        return f"TensorObserver({self.name!r}, n={self.n}, absmax={self.absmax:.4g}, crest={self.crest_factor:.3g})"


# =====================================================================================
# Weights, tables, profiling
# =====================================================================================


def weight_stats(weight: torch.Tensor, bins: int = DEFAULT_BINS) -> dict[str, Any]:
    """Statistics of a weight matrix [out, in]: the observer summary over all elements plus
    `channel_absmax` per output channel ([out]) and `in_channel_absmax` per input channel ([in])."""
    w = as_float_tensor(weight)
    if w.ndim != 2:
        raise FFNQuantError(f"weight must be a matrix [out, in], got shape {tuple(w.shape)}")
    obs = TensorObserver(bins, "weight").update(w.t())  # channels = output rows
    stats = obs.summary()
    stats["shape"] = list(w.shape)
    stats["channel_absmax"] = obs.channel_absmax.tolist()
    step = max(1, _CHUNK // max(1, w.shape[1]))  # |w| a row chunk at a time, like the observer
    in_absmax = torch.stack([w[i:i + step].abs().amax(dim=0) for i in range(0, w.shape[0], step)]).amax(dim=0)
    stats["in_channel_absmax"] = in_absmax.to(torch.float64).tolist()
    return stats


@dataclass
class RangeTable:
    """Per-site observers (and weight statistics) of one FFN over a calibration set."""

    spec: FFNSpec | None
    sites: dict[str, TensorObserver] = field(default_factory=dict)
    weights: dict[str, dict[str, Any]] = field(default_factory=dict)
    n_tokens: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, site: str) -> TensorObserver:
        try:
            return self.sites[site]
        except KeyError:
            raise unknown_choice("site", site, list(self.sites)) from None

    def __contains__(self, site: object) -> bool:
        return site in self.sites

    def __iter__(self) -> Iterator[str]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def keys(self):
        return self.sites.keys()

    def items(self):
        return self.sites.items()

    @property
    def variant(self) -> str | None:
        return self.spec.variant.value if self.spec is not None else None

    def merge(self, other: "RangeTable") -> "RangeTable":
        """A new table over both tables' tokens; same spec and sites required, weights taken from self."""
        if not isinstance(other, RangeTable):
            raise FFNQuantError(f"cannot merge a RangeTable with {type(other).__name__}")
        if self.spec != other.spec:
            a = self.spec.key if self.spec else None
            b = other.spec.key if other.spec else None
            raise FFNQuantError(f"cannot merge range tables of different FFNs ({a} vs {b})")
        if set(self.sites) != set(other.sites):
            raise FFNQuantError(f"cannot merge range tables over different sites ({sorted(self.sites)} vs {sorted(other.sites)})")
        return RangeTable(
            self.spec,
            {s: self.sites[s].merge(other.sites[s]) for s in self.sites},
            dict(self.weights or other.weights),
            self.n_tokens + other.n_tokens,
            dict(self.meta),
        )

    def summary(self) -> dict[str, Any]:
        """Scalars only: per-site summaries and weight statistics without the per-channel arrays."""
        return {
            "spec": self.spec.to_dict() if self.spec is not None else None,
            "n_tokens": self.n_tokens,
            "meta": self.meta,
            "sites": {s: o.summary() for s, o in self.sites.items()},
            "weights": {
                w: {k: v for k, v in st.items() if k not in ("channel_absmax", "in_channel_absmax")}
                for w, st in self.weights.items()
            },
        }

    def to_dict(self) -> dict[str, Any]:
        """Full state (mergeable, reloadable with `from_dict`), JSON-able."""
        return {
            "state_version": _STATE_VERSION,
            "spec": self.spec.to_dict() if self.spec is not None else None,
            "n_tokens": self.n_tokens,
            "meta": self.meta,
            "sites": {s: o.to_dict() for s, o in self.sites.items()},
            "weights": self.weights,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RangeTable":
        if data.get("state_version") != _STATE_VERSION:
            raise FFNQuantError(f"range table state version {data.get('state_version')!r} is not {_STATE_VERSION}")
        try:
            spec = FFNSpec.from_dict(data["spec"]) if data.get("spec") is not None else None
            sites = {str(s): TensorObserver.from_dict(o) for s, o in data["sites"].items()}
            return cls(spec, sites, dict(data.get("weights", {})), int(data["n_tokens"]), dict(data.get("meta", {})))
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise FFNQuantError(f"malformed range table: {exc}") from exc


def _resolve_sites(model: FFN, sites: Sequence[str] | None) -> list[str]:
    available = list(model.taps.keys())
    if sites is None:
        return available
    out = []
    for s in sites:
        if s not in available:
            raise unknown_choice(f"site for {model.spec.variant.value}", s, available)
        if s not in out:
            out.append(s)
    return out


def profile(
    model: FFN,
    batches: Iterable[torch.Tensor],
    sites: Sequence[str] | None = None,
    bins: int = DEFAULT_BINS,
    weights: bool = True,
) -> RangeTable:
    """Observe `sites` (default: all of the model's) over `batches` (..., d_model) via forward hooks
    on `model.taps`; hooks are removed afterwards, also on error. Nothing stores activations."""
    names = _resolve_sites(model, sites)
    observers = {s: TensorObserver(bins, s) for s in names}
    d_model = model.spec.d_model
    handles = []

    # Sites that receive the very same tensor object in one forward pass (a dense FFN's `act`
    # and `hidden`) share one batch computation: the cache holds the pass's tensors only.
    seen: list[tuple[torch.Tensor, TensorObserver]] = []
    workspace = Workspace()  # one set of scratch buffers for all sites, reused every batch

    def make_hook(obs: TensorObserver):
        def hook(module, inputs, output):  # returns None: the tensor passes through unchanged
            batch = next((b for t, b in seen if t is output), None)
            if batch is None:
                batch = TensorObserver.of_batch(output, bins, obs.name, workspace)
                seen.append((output, batch))
            obs.absorb(batch)

        return hook

    n_tokens = 0
    try:
        for s in names:
            handles.append(model.taps[s].register_forward_hook(make_hook(observers[s])))
        with torch.no_grad():
            for i, batch in enumerate(batches):
                if not isinstance(batch, torch.Tensor):
                    batch = as_float_tensor(batch)
                if batch.ndim < 1 or batch.shape[-1] != d_model:
                    raise FFNQuantError(f"batch {i} has shape {tuple(batch.shape)}; expected (..., {d_model})")
                param = next(model.parameters())
                model(batch.to(device=param.device, dtype=param.dtype))
                seen.clear()
                n_tokens += batch.numel() // d_model
    finally:
        seen.clear()
        for h in handles:
            h.remove()
    weight_table = {}
    if weights:
        weight_table = {name: weight_stats(w, bins) for name, w in model.weights().items()}
    return RangeTable(model.spec, observers, weight_table, n_tokens)


def profile_spec(
    spec: FFNSpec,
    source,
    n_tokens: int,
    seed: int = 0,
    batch_size: int = 1024,
    sites: Sequence[str] | None = None,
    bins: int = DEFAULT_BINS,
    model: FFN | None = None,
) -> RangeTable:
    """Build the FFN for `spec` (weights from `seed`, unless `model` is given) and profile it over
    `n_tokens` tokens streamed from `source` (a `TokenSource`) in batches of `batch_size`."""
    if not isinstance(source, TokenSource):
        raise FFNQuantError(f"source must be a TokenSource, got {type(source).__name__}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens <= 0:
        raise FFNQuantError(f"number of tokens must be a positive integer, got {n_tokens!r}")
    model = model if model is not None else build(spec, seed=seed)
    table = profile(model, source.batches(n_tokens, spec.d_model, batch_size), sites=sites, bins=bins)
    table.meta = {"source": source.to_dict(), "source_label": source.label, "weight_seed": seed, "batch_size": batch_size}
    return table
