"""The layer atlas: per layer x site, how hard the ranges are and where the largest values sit.

`layer_atlas` reads the range tables (crest factor, Pearson kurtosis, outlier channel counts,
absmax, the channels with the largest absmax) and returns a JSON-able dict. Token positions are
not in a range table: `top_positions` runs an FFN over calibration sequences ([seq_len, d_model]
each; position = row index within its sequence) with hooks on `ffn.taps` and keeps, per site, the
k largest |values| with (sequence, position, channel) and how many of the top `top_fraction`
magnitudes fall at position 0 (trained Llama-family models put their "massive activations" on
the first token of a sequence). `PositionTracker` is the streaming form (memory: one batch plus
the top set); `hf.layerwise.model_top_positions` feeds it a real model's FFN inputs, batch by batch.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from .errors import FFNQuantError, unknown_choice
from .model import FFN
from .numerics.observe import OUTLIER_KS, RangeTable
from .spec import SITES

__all__ = [
    "ATLAS_KS",
    "TOP_FRACTION",
    "STANDOUT_RATIO",
    "SCHEMA",
    "layer_key",
    "split_sequences",
    "PositionTracker",
    "top_positions",
    "layer_atlas",
]

SCHEMA = "ffnquant.atlas"
# The outlier thresholds the atlas counts: channels above 6x and 20x the median channel absmax.
ATLAS_KS = tuple(k for k in OUTLIER_KS if k >= 6.0)
# "The largest magnitudes" of a site: its top 0.01% of |values| (p99.99 of the range report).
TOP_FRACTION = 1e-4
# A layer stands out at a site when its absmax is this many times the median layer's there: massive activations
# (hundreds to thousands) against the tens of the mild layers; relative, so it needs no model-specific scale.
STANDOUT_RATIO = 10.0
_LABEL = re.compile(r"L(\d+)(?:\.e(\d+))?")


def layer_key(key: str) -> tuple[str, int | None, int | None]:
    """(label, layer index, expert) of a range-table key: 'llama:L3' -> ('L3', 3, None), 'L3.e1' -> ('L3.e1', 3, 1);
    a key that names no model layer (a synthetic variant) gives (key, None, None)."""
    label = key.split(":", 1)[1] if ":" in key else key
    m = _LABEL.fullmatch(label)
    if not m:
        return key, None, None
    return label, int(m.group(1)), (int(m.group(2)) if m.group(2) is not None else None)


def split_sequences(x: torch.Tensor, seq_len: int) -> list[torch.Tensor]:
    """A layer's captured calibration rows [tokens, d_model] as its sequences: `hf.capture` runs the text in windows
    of `seq_len` tokens and flattens each batch [batch, seq_len] row-major, so the rows are whole windows in order
    (a shorter last window where the text ran out)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise FFNQuantError(f"seq_len must be a positive integer, got {seq_len!r}")
    if not isinstance(x, torch.Tensor) or x.ndim != 2:
        raise FFNQuantError(f"calibration rows must be a [tokens, d_model] tensor, got {getattr(x, 'shape', type(x))}")
    return list(torch.split(x, seq_len)) if x.shape[0] else []


def _check_fraction(top_fraction: float) -> float:
    f = float(top_fraction)
    if not 0.0 < f <= 1.0:
        raise FFNQuantError(f"top_fraction must be in (0, 1], got {top_fraction!r}")
    return f


class PositionTracker:
    """Streaming top values of an FFN's sites with their (sequence, position, channel).

    `max_tokens` bounds the tokens that will be fed: the tracker keeps the top `top_fraction` of that many values per
    site (at least `k`), a superset of the top set of what it actually sees, so the result is exact for any count up
    to it; feeding more raises.
    """

    def __init__(self, ffn: FFN, max_tokens: int, sites: Sequence[str] | None = None, k: int = 5,
                 top_fraction: float = TOP_FRACTION) -> None:
        if not isinstance(ffn, FFN):
            raise FFNQuantError(f"expected an ffnquant FFN, got {type(ffn).__name__}")
        for name, value in (("k", k), ("max_tokens", max_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FFNQuantError(f"{name} must be a positive integer, got {value!r}")
        available = list(ffn.taps.keys())
        names = available if sites is None else list(dict.fromkeys(sites))
        for s in names:
            if s not in available:
                raise unknown_choice(f"site for {ffn.spec.variant.value}", s, available)
        self.ffn, self.sites, self.k, self.max_tokens = ffn, names, k, max_tokens
        self.top_fraction = _check_fraction(top_fraction)
        self.n_tokens = 0
        self.n_sequences = 0
        self._channels: dict[str, int] = {}
        # per site: |value|, value, sequence, position, channel of the kept candidates (sorted by |value|, largest first)
        self._top: dict[str, tuple[torch.Tensor, ...]] = {}

    def _cap(self, channels: int) -> int:
        return max(self.k, math.ceil(self.top_fraction * self.max_tokens * channels))

    def _absorb(self, site: str, y: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor) -> None:
        y = y.detach().reshape(-1, y.shape[-1]).float()
        ch = y.shape[-1]
        self._channels[site] = ch
        flat = y.reshape(-1)
        mag = flat.abs()
        keep = min(self._cap(ch), mag.numel())
        vals, idx = torch.topk(mag, keep)
        rows = idx // ch
        cand = (vals, flat[idx], seq[rows], pos[rows], idx % ch)
        if site in self._top:
            cand = tuple(torch.cat([a, b]) for a, b in zip(self._top[site], cand))
            keep = min(self._cap(ch), cand[0].numel())
            _, order = torch.topk(cand[0], keep)
            cand = tuple(t[order] for t in cand)
        self._top[site] = cand

    def update(self, sequences: Sequence[torch.Tensor]) -> "PositionTracker":
        """Run the FFN over `sequences` (each [seq_len, d_model], in order; they continue the sequence count)."""
        seqs = [s for s in sequences]
        d = self.ffn.spec.d_model
        for i, s in enumerate(seqs):
            if not isinstance(s, torch.Tensor) or s.ndim != 2 or s.shape[1] != d or s.shape[0] == 0:
                raise FFNQuantError(f"sequence {self.n_sequences + i} must be a non-empty [seq_len, {d}] tensor, "
                                    f"got {tuple(getattr(s, 'shape', ()))}")
        if not seqs:
            return self
        lengths = torch.tensor([s.shape[0] for s in seqs])
        n = int(lengths.sum())
        if self.n_tokens + n > self.max_tokens:
            raise FFNQuantError(f"{self.n_tokens + n} tokens fed, more than max_tokens={self.max_tokens}: the top set "
                                "kept would not be exact")
        seq = torch.repeat_interleave(torch.arange(len(seqs)) + self.n_sequences, lengths)
        starts = torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        pos = torch.arange(n) - starts
        handles = []

        def hook_for(site: str):
            def hook(module, inputs, output):  # returns None: the tensor passes through unchanged
                self._absorb(site, output, seq, pos)
            return hook

        param = next(self.ffn.parameters())
        try:
            for s in self.sites:
                handles.append(self.ffn.taps[s].register_forward_hook(hook_for(s)))
            with torch.no_grad():
                self.ffn(torch.cat(seqs).to(device=param.device, dtype=param.dtype))
        finally:
            for h in handles:
                h.remove()
        self.n_tokens += n
        self.n_sequences += len(seqs)
        return self

    def result(self) -> dict[str, dict[str, Any]]:
        """Per site: the `k` largest |values| (sequence, position, channel, value), the top `top_fraction` set's count
        at position 0 and elsewhere, the share position 0 would have by chance, and the positions and channels that
        recur in the top set (JSON-able)."""
        out: dict[str, dict[str, Any]] = {}
        for site in self.sites:
            if site not in self._top:
                continue
            ch = self._channels[site]
            n_values = self.n_tokens * ch
            count = max(1, math.ceil(self.top_fraction * n_values))
            kept = self._top[site]
            # equal magnitudes (a value planted in every sequence) in reading order: sequence, position, channel
            order = torch.from_numpy(np.lexsort(tuple(t.numpy() for t in (kept[4], kept[3], kept[2], -kept[0]))))
            top_val, top_seq, top_pos, top_chan = (t[order][: self.k] for t in kept[1:])
            mag, val, seq, pos, chan = (t[order][:count] for t in kept)
            at0 = int((pos == 0).sum())
            out[site] = {
                "n_tokens": self.n_tokens,
                "n_sequences": self.n_sequences,
                "n_values": n_values,
                "top": [{"sequence": int(top_seq[i]), "position": int(top_pos[i]), "channel": int(top_chan[i]),
                         "value": float(top_val[i])} for i in range(len(top_val))],
                "top_fraction": self.top_fraction,
                "top_count": count,
                "threshold": float(mag[-1]),
                "position0": at0,
                "elsewhere": count - at0,
                "position0_share": at0 / count,
                # the share of the top set position 0 would hold if position did not matter
                "position0_baseline": self.n_sequences / self.n_tokens,
                "top_set_positions": [[int(p), c] for p, c in Counter(pos.tolist()).most_common(self.k)],
                "top_set_channels": [[int(c), n] for c, n in Counter(chan.tolist()).most_common(self.k)],
            }
        return out


def top_positions(ffn: FFN, sequences: Sequence[torch.Tensor], sites: Sequence[str] | None = None, k: int = 5,
                  top_fraction: float = TOP_FRACTION) -> dict[str, dict[str, Any]]:
    """Per site of `ffn` (default: all), the `k` largest |values| over `sequences` (each [seq_len, d_model];
    position = row index within its sequence) and how many of the top `top_fraction` magnitudes sit at position 0
    (`PositionTracker.result`)."""
    seqs = list(sequences)
    if not seqs:
        raise FFNQuantError("no sequences to run")
    total = sum(int(s.shape[0]) if isinstance(s, torch.Tensor) and s.ndim == 2 else 1 for s in seqs)
    tracker = PositionTracker(ffn, max(1, total), sites, k, top_fraction)
    return tracker.update(seqs).result()


def _num(v: float) -> float | None:
    return float(v) if v == v and math.isfinite(v) else None


def _site_cell(obs, top_channels: int) -> dict[str, Any]:
    ca = obs.channel_absmax
    median = float(np.median(ca)) if ca.size else None
    order = np.argsort(-ca, kind="stable")[:top_channels]
    return {
        "crest_factor": _num(obs.crest_factor),
        "kurtosis": _num(obs.kurtosis),
        "absmax": _num(obs.absmax),
        "std": _num(obs.std),
        "channels": obs.channels,
        "outlier_channels": {f"{k:g}": obs.outlier_channels(k) for k in ATLAS_KS},
        "channel_absmax_median": median,
        "top_channels": [{"channel": int(c), "absmax": float(ca[c]),
                          "ratio": float(ca[c]) / median if median else None} for c in order],
    }


def _worst(rows: list[dict], site: str, stat: str, n: int) -> list[dict[str, Any]]:
    got = [(r["sites"][site][stat], r) for r in rows if site in r["sites"] and r["sites"][site][stat] is not None]
    got.sort(key=lambda p: -p[0])
    return [{"key": r["key"], "label": r["label"], "value": v} for v, r in got[:n]]


def _recurring(rows: list[dict], site: str, min_ratio: float) -> list[dict[str, Any]]:
    """Channels among a layer's top channels, above `min_ratio` x the median, in more than one layer."""
    seen: dict[int, list[tuple[str, float]]] = {}
    for r in rows:
        cell = r["sites"].get(site)
        for c in (cell or {}).get("top_channels", []):
            if c["ratio"] is not None and c["ratio"] > min_ratio:
                seen.setdefault(c["channel"], []).append((r["label"], c["absmax"]))
    out = [{"channel": ch, "layers": [lab for lab, _ in hits], "max_absmax": max(a for _, a in hits)}
           for ch, hits in seen.items() if len(hits) > 1]
    out.sort(key=lambda d: (-len(d["layers"]), -d["max_absmax"]))
    return out


def _standouts(rows: list[dict], site: str) -> list[dict[str, Any]]:
    """The layers whose absmax at `site` is at least `STANDOUT_RATIO` x the median layer's, largest first, with where
    their largest value sits (when positions were measured)."""
    cells = [(r, r["sites"][site]) for r in rows if site in r["sites"] and r["sites"][site]["absmax"] is not None]
    if len(cells) < 3:  # a median of one or two layers says nothing about the rest
        return []
    median = float(np.median([c["absmax"] for _, c in cells]))
    out = []
    for r, c in cells:
        if median > 0 and c["absmax"] >= STANDOUT_RATIO * median:
            top = c["positions"]["top"][0] if c.get("positions") and c["positions"]["top"] else None
            out.append({"key": r["key"], "label": r["label"], "absmax": c["absmax"], "ratio": c["absmax"] / median,
                        "crest_factor": c["crest_factor"], "kurtosis": c["kurtosis"],
                        "channel": top["channel"] if top else c["top_channels"][0]["channel"],
                        "position": top["position"] if top else None,
                        "position0_share": c["positions"]["position0_share"] if c.get("positions") else None})
    out.sort(key=lambda d: -d["absmax"])
    return out


def layer_atlas(tables: Mapping[str, RangeTable], top_values: Mapping[str, Mapping[str, Any]] | None = None,
                top_channels: int = 5, worst: int = 3) -> dict[str, Any]:
    """The atlas of `tables` (key -> RangeTable, e.g. 'llama:L3'): per layer and site the crest factor, Pearson
    kurtosis, outlier channel counts (k in `ATLAS_KS`), absmax and the `top_channels` channels by absmax; with
    `top_values` (key or layer label -> site -> `top_positions` result) also where the top values sit. Adds the
    `worst` layers per site by crest and kurtosis, the layers whose absmax stands out (`STANDOUT_RATIO` x the median
    layer's) and the channels that recur across layers at the d_model-wide sites
    (input, output: the residual stream's channels; d_ff channels are each layer's own neurons). JSON-able."""
    if not tables:
        raise FFNQuantError("no range tables for the atlas")
    for name, value in (("top_channels", top_channels), ("worst", worst)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise FFNQuantError(f"{name} must be a positive integer, got {value!r}")
    top_values = top_values or {}
    rows = []
    for key, table in tables.items():
        if not isinstance(table, RangeTable):
            raise FFNQuantError(f"atlas entry {key!r} is a {type(table).__name__}, not a RangeTable")
        label, index, expert = layer_key(key)
        positions = top_values.get(key, top_values.get(label, {}))
        sites = {}
        for site in SITES:
            if site in table and table[site].n:
                cell = _site_cell(table[site], top_channels)
                cell["positions"] = positions.get(site)
                sites[site] = cell
        rows.append({"key": key, "label": label, "index": index, "expert": expert, "n_tokens": table.n_tokens,
                     "d_model": table.spec.d_model if table.spec is not None else None, "sites": sites})
    if all(r["index"] is not None for r in rows):  # model layers in depth order, experts after their layer's
        rows.sort(key=lambda r: (r["index"], -1 if r["expert"] is None else r["expert"]))
    present = [s for s in SITES if any(s in r["sites"] for r in rows)]
    widths = {r["d_model"] for r in rows}
    residual = [s for s in present if all(r["sites"][s]["channels"] in widths for r in rows if s in r["sites"])]
    return {
        "schema": SCHEMA,
        "sites": present,
        "outlier_ks": list(ATLAS_KS),
        "top_fraction": next((c["positions"]["top_fraction"] for r in rows for c in r["sites"].values()
                              if c["positions"]), None),
        "positions_measured": any(c["positions"] for r in rows for c in r["sites"].values()),
        "layers": rows,
        "standout_ratio": STANDOUT_RATIO,
        "standouts": {s: _standouts(rows, s) for s in present},
        "worst": {s: {stat: _worst(rows, s, stat, worst) for stat in ("crest_factor", "kurtosis")} for s in present},
        "recurring_channels": {s: _recurring(rows, s, ATLAS_KS[0]) for s in residual},
    }
