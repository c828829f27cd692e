"""The range report: ranges.json, ranges.md and two plots, rendered in memory and then written atomically."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import FFNQuantError
from ..infra.atomic import ensure_writable_dir, write_bytes, write_text
from ..infra.envinfo import environment
from ..infra.render import markdown_table
from ..numerics.observe import RangeTable
from ..ranges import OUTLIER_K, claims, findings, pct
from ..spec import SITES
from .plots import png

__all__ = ["SCHEMA", "SCHEMA_VERSION", "REPORT_FILES", "range_report_dict", "range_report_markdown", "render_plots",
           "write_range_report"]

SCHEMA = "ffnquant.ranges"
SCHEMA_VERSION = 1
REPORT_FILES = {
    "json": "ranges.json",
    "markdown": "ranges.md",
    "hidden_histogram": "ranges_hidden_hist.png",
    "crest_kurtosis": "ranges_crest_kurtosis.png",
}


def _check_tables(tables: Mapping[str, RangeTable]) -> None:
    if not tables:
        raise FFNQuantError("no range tables to report")
    for v, t in tables.items():
        if not isinstance(t, RangeTable):
            raise FFNQuantError(f"range report entry {v!r} is a {type(t).__name__}, not a RangeTable")
        if t.n_tokens <= 0 or not t.sites:
            raise FFNQuantError(f"range table for {v!r} holds no observations")


def range_report_dict(tables: Mapping[str, RangeTable], meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ranges.json content: schema, environment, meta, per-variant summaries, findings, claims,
    and the full mergeable state of every table (reload with `RangeTable.from_dict`)."""
    _check_tables(tables)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "environment": environment(),
        "meta": dict(meta or {}),
        "variants": {v: t.summary() for v, t in tables.items()},
        "findings": findings(tables),
        "claims": claims(tables),
        "plots": {k: REPORT_FILES[k] for k in ("hidden_histogram", "crest_kurtosis")},
        "tables": {v: t.to_dict() for v, t in tables.items()},
    }


def _site_rows(tables: Mapping[str, RangeTable], site: str) -> list[list[Any]]:
    rows = []
    for v, t in tables.items():
        if site not in t:
            continue
        o = t[site]
        rows.append(
            [v, o.absmax, o.std, o.crest_factor, o.kurtosis, o.abs_percentile(99.99), pct(o.zero_fraction),
             o.dead_units, o.outlier_channels(OUTLIER_K)]
        )
    return rows


def _header_line(tables: Mapping[str, RangeTable], meta: Mapping[str, Any]) -> str:
    """What was measured, from the tables themselves: how many variants or model layers, their widths,
    tokens, data, and the weights' seed only where the weights were drawn from one (never a '?')."""
    first = next(iter(tables.values()))
    layers = [k for k in tables if ":" in k]  # a real model's layers are keyed '<model_type>:<label>'
    n_var = len(tables) - len(layers)
    what = " and ".join(p for p in (f"{n_var} variant(s)" if n_var else "",
                                     f"{len(layers)} model layer(s)" if layers else "") if p)
    widths = sorted({t.spec.d_model for t in tables.values() if t.spec is not None})
    tokens = sorted({t.n_tokens for t in tables.values()})
    text = f"{what}"
    if widths:
        text += f" at d_model {', '.join(str(w) for w in widths)}"
    text += f", {tokens[0]:,}" + (f" to {tokens[-1]:,}" if len(tokens) > 1 else "") + " tokens"
    source = meta.get("source_label", first.meta.get("source_label"))
    if source:
        text += f" from {source}"
    seed = meta.get("seed", first.meta.get("weight_seed"))
    if n_var and seed is not None:
        text += f", random weights of seed {seed}" + (" (model layers: trained weights)" if layers else "")
    elif layers:
        text += ", trained weights"
    return (text + f", {first[next(iter(first.sites))].histogram.n_bins} histogram bins. "
            "Crest factor = absmax/std; kurtosis is Pearson's (3 for a Gaussian); percentiles are of |x|; "
            f"outlier channels have absmax above {OUTLIER_K:g}x the median channel's.")


def range_report_markdown(
    tables: Mapping[str, RangeTable],
    meta: Mapping[str, Any] | None = None,
    plots: Mapping[str, str] | None = None,
    heading_level: int = 1,
) -> str:
    """The Markdown body (embeddable: pass `heading_level=2` to nest it under another report)."""
    _check_tables(tables)
    h = "#" * heading_level
    meta = dict(meta or {})
    lines = [f"{h} FFN activation ranges", ""]
    lines.append(_header_line(tables, meta))
    lines += ["", f"{h}# Findings", ""]
    lines += [f"- {f['text']}" for f in findings(tables)]
    lines += ["", f"{h}# Seed claims checked", ""]
    lines.append(
        markdown_table(["claim", "status", "measured"], [[c["claim"], c["status"], c["detail"]] for c in claims(tables)])
    )
    if plots:
        lines += ["", f"{h}# Plots", ""]
        titles = {"hidden_histogram": "`hidden` histograms", "crest_kurtosis": "crest factor and kurtosis per site"}
        lines += [f"![{titles.get(k, k)}]({p})" for k, p in plots.items()]
    lines += ["", f"{h}# Per-site statistics", ""]
    headers = ["variant", "absmax", "std", "crest", "kurtosis", "p99.99 |x|", "zeros", "dead units", f"outlier ch. (>{OUTLIER_K:g}x)"]
    for site in SITES:
        rows = _site_rows(tables, site)
        if rows:
            lines += [f"**`{site}`**", "", markdown_table(headers, rows), ""]
    lines += [f"{h}# Weights", ""]
    rows = []
    for v, t in tables.items():
        for name, st in t.weights.items():
            med = st.get("channel_absmax_median")
            mx = st.get("channel_absmax_max")
            rows.append([v, name, "x".join(map(str, st["shape"])), st["absmax"], st["std"], st["crest_factor"], st["kurtosis"],
                         (mx / med) if med else None])
    if rows:
        lines.append(markdown_table(["variant", "weight", "shape", "absmax", "std", "crest", "kurtosis", "max/median row absmax"], rows))
    else:
        lines.append("No weight statistics were collected.")
    return "\n".join(lines).rstrip() + "\n"


def render_plots(tables: Mapping[str, RangeTable]) -> dict[str, bytes]:
    """PNG bytes: 'hidden_histogram' (log-scale `hidden` histograms, raw and in units of std) and
    'crest_kurtosis' (per variant and site)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt
    import numpy as np

    _check_tables(tables)
    out: dict[str, bytes] = {}
    cmap = plt.get_cmap("tab10")
    colours = {v: cmap(i % 10) for i, v in enumerate(tables)}

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for v, t in tables.items():
        if "hidden" not in t or t["hidden"].n == 0:
            continue
        o = t["hidden"]
        hist = o.histogram
        width = hist.bin_width
        counts = hist.counts.astype(float)
        keep = counts > 0
        density = counts / (counts.sum() * width)
        centres = hist.centers
        axes[0].plot(centres[keep], density[keep], lw=1, label=v, color=colours[v])
        std = o.std or 1.0
        axes[1].plot(centres[keep] / std, density[keep] * std, lw=1, label=v, color=colours[v])
    axes[0].set(title="`hidden` histogram", xlabel="value", ylabel="density (log)", yscale="log")
    axes[1].set(title="`hidden` in units of its std", xlabel="value / std", ylabel="density (log)", yscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, ncol=2)
    fig.tight_layout()
    out["hidden_histogram"] = png(fig)

    sites = [s for s in SITES if any(s in t for t in tables.values())]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(sites) * max(1, len(tables)) / 3), 7.5), sharex=True)
    n = len(tables)
    width = 0.8 / n
    x = np.arange(len(sites))
    for i, (v, t) in enumerate(tables.items()):
        crest = [t[s].crest_factor if s in t else np.nan for s in sites]
        kurt = [t[s].kurtosis if s in t else np.nan for s in sites]
        axes[0].bar(x + (i - (n - 1) / 2) * width, crest, width, label=v, color=colours[v])
        axes[1].bar(x + (i - (n - 1) / 2) * width, kurt, width, label=v, color=colours[v])
    axes[0].set(title="crest factor (absmax / std) per site", ylabel="crest factor")
    axes[1].set(title="kurtosis per site (3 = Gaussian)", ylabel="kurtosis (log)", yscale="log")
    axes[1].axhline(3.0, color="grey", lw=0.8, ls="--")
    axes[1].set_xticks(x, sites)
    axes[0].legend(fontsize=8, ncol=min(n, 5))
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out["crest_kurtosis"] = png(fig)
    return out


def write_range_report(
    tables: Mapping[str, RangeTable], out_dir: str | os.PathLike, meta: Mapping[str, Any] | None = None
) -> dict[str, Path]:
    """Write ranges.json, ranges.md and the two PNG plots into `out_dir`; returns their paths.

    Everything is rendered and validated in memory first (JSON without NaN, plots drawn), so
    a failure leaves no file behind; each file is then written atomically.
    """
    _check_tables(tables)
    data = range_report_dict(tables, meta)
    try:
        text = json.dumps(data, indent=1, sort_keys=True, allow_nan=False, default=str) + "\n"
    except ValueError as exc:
        raise FFNQuantError(f"range report has a non-finite number: {exc}") from exc
    plots = render_plots(tables)
    markdown = range_report_markdown(tables, meta, plots={k: REPORT_FILES[k] for k in plots})
    folder = ensure_writable_dir(out_dir)
    paths = {}
    for key, blob in plots.items():
        paths[key] = write_bytes(folder / REPORT_FILES[key], blob)
    paths["json"] = write_text(folder / REPORT_FILES["json"], text)
    paths["markdown"] = write_text(folder / REPORT_FILES["markdown"], markdown)
    return paths
