"""The run report's plots (PNG bytes in memory), and `png`, the one figure-to-bytes helper of every report."""

from __future__ import annotations

import io
import math
import re
from typing import Any, Mapping

from ..measure.recommend import pareto_front
from .view import _keys, _ok_cases, _points, _runtimes_with_cases, _scheme_order, _variants

def png(fig) -> bytes:
    """A matplotlib figure as PNG bytes (closed afterwards); equal figures give equal bytes."""
    buf = io.BytesIO()
    # Fixed metadata so that equal figures give equal bytes (matplotlib stamps the version otherwise).
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight", metadata={"Software": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    return buf.getvalue()


def _grid(n: int, max_cols: int = 3) -> tuple[int, int]:
    cols = min(max_cols, max(1, n))
    return math.ceil(n / cols), cols


def _variant_panels(doc: Mapping[str, Any], variants: list[str], panel_height: float):
    """One subplot per variant (unused cells hidden), the schemes in report order and a colour per scheme."""
    import matplotlib.pyplot as plt

    rows, cols = _grid(len(variants))
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, panel_height * rows), squeeze=False)
    for ax in axes.flat[len(variants):]:
        ax.axis("off")
    schemes = _scheme_order(doc)
    colours = {s: plt.cm.tab10(i % 10) for i, s in enumerate(schemes)}
    return fig, list(zip(axes.flat, variants)), schemes, colours


def _plot_hidden_hist(doc: Mapping[str, Any]) -> bytes | None:
    import matplotlib.pyplot as plt
    import numpy as np

    hists = {v: d.get("hidden_histogram") for v, d in doc["ranges"]["variants"].items() if d.get("hidden_histogram")}
    if not hists:
        return None
    fig, ax = plt.subplots(figsize=(10, 5))
    for v, h in hists.items():
        edges = np.asarray(h["edges"], dtype=float)
        counts = np.asarray(h["counts"], dtype=float)
        std = doc["ranges"]["variants"][v]["sites"].get("hidden", {}).get("std") or 1.0
        # Normalise to densities over x/std so variants with different scales share one axis.
        widths = np.diff(edges) / std
        density = counts / max(counts.sum(), 1.0) / np.where(widths > 0, widths, 1.0)
        centres = (edges[:-1] + edges[1:]) / 2 / std
        ax.step(centres, np.where(density > 0, density, np.nan), where="mid", label=v, linewidth=1.2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden value / std of hidden")
    ax.set_ylabel("density (log scale)")
    ax.set_title("`hidden` (the down projection's input) per variant")
    ax.grid(True, alpha=0.3)
    ax.legend(ncol=3, fontsize=8)
    return png(fig)


def _plot_crest_kurtosis(doc: Mapping[str, Any]) -> bytes | None:
    import matplotlib.pyplot as plt
    import numpy as np

    variants = [v for v in _variants(doc) if v in doc["ranges"]["variants"]]
    if not variants:
        return None
    sites = [s for s in ("input", "gate_pre", "up", "act", "hidden", "output")
             if any(s in doc["ranges"]["variants"][v]["sites"] for v in variants)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(variants)
    x = np.arange(len(sites))
    for stat, ax in zip(("crest_factor", "kurtosis"), axes):
        for i, v in enumerate(variants):
            vals = [doc["ranges"]["variants"][v]["sites"].get(s, {}).get(stat) for s in sites]
            ax.bar(x + (i - (len(variants) - 1) / 2) * width, [np.nan if a is None else a for a in vals], width, label=v)
        ax.set_xticks(x, sites)
        ax.set_title({"crest_factor": "crest factor (absmax / std)", "kurtosis": "kurtosis"}[stat])
        ax.grid(True, axis="y", alpha=0.3)
        if stat == "kurtosis":
            ax.set_yscale("log")
    axes[0].legend(ncol=3, fontsize=7)
    return png(fig)


def _plot_scatter(doc: Mapping[str, Any], runtime: str, tokens: int) -> bytes | None:
    target = float(doc["config"].get("target_db", 30.0))
    variants = [v for v in _keys(doc) if _points(doc, runtime, tokens, v)]
    if not variants:
        return None
    fig, panels, schemes, colours = _variant_panels(doc, variants, panel_height=3.6)
    for ax, v in panels:
        pts = _points(doc, runtime, tokens, v)
        quant = [p for p in pts if p.sqnr_db is not None]
        for p in quant:
            ax.scatter(p.latency_s * 1e3, p.sqnr_db, color=colours[p.scheme], s=36, zorder=3)
            ax.annotate(p.scheme, (p.latency_s * 1e3, p.sqnr_db), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = pareto_front(quant)
        if len(front) > 1:
            ax.plot([p.latency_s * 1e3 for p in front], [p.sqnr_db for p in front], "k--", linewidth=1, zorder=2,
                    label="Pareto front")
        elif front:
            ax.scatter([front[0].latency_s * 1e3], [front[0].sqnr_db], facecolors="none", edgecolors="k", s=120,
                       label="Pareto front")
        base = next((p for p in pts if p.sqnr_db is None), None)
        if base is not None:
            ax.axvline(base.latency_s * 1e3, color="grey", linestyle=":", label=f"{base.scheme} latency")
        ax.axhline(target, color="tab:red", linestyle="-.", linewidth=0.8, label=f"target {target:g} dB")
        ax.set_xscale("log")
        _plain_log_axis(ax.xaxis)
        ax.set_title(v, fontsize=10)
        ax.set_xlabel("median latency (ms, log)", fontsize=8)
        ax.set_ylabel("SQNR (dB)", fontsize=8)
        ax.grid(True, alpha=0.3)
    panels[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"accuracy vs latency on {runtime} at M={tokens} tokens (higher and further left is better)")
    fig.tight_layout()
    return png(fig)


def _plot_latency_tokens(doc: Mapping[str, Any], runtime: str) -> bytes | None:
    cases = [c for c in _ok_cases(doc) if c["runtime"] == runtime]
    variants = [v for v in _keys(doc) if any(c["variant"] == v for c in cases)]
    if not variants:
        return None
    fig, panels, schemes, colours = _variant_panels(doc, variants, panel_height=3.4)
    for ax, v in panels:
        for s in schemes:
            pts = sorted((c["tokens"], c["median_s"]) for c in cases if c["variant"] == v and c["scheme"] == s)
            if pts:
                ax.plot([t for t, _ in pts], [m * 1e3 for _, m in pts], "o-", color=colours[s], label=s, markersize=3)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _plain_log_axis(ax.xaxis)
        _plain_log_axis(ax.yaxis)
        ax.set_title(v, fontsize=10)
        ax.set_xlabel("tokens M (log)", fontsize=8)
        ax.set_ylabel("median latency (ms, log)", fontsize=8)
        ax.grid(True, alpha=0.3)
    panels[0][0].legend(fontsize=7)
    fig.suptitle(f"latency vs tokens on {runtime}")
    fig.tight_layout()
    return png(fig)


def _plain_log_axis(axis) -> None:
    """Log-scale ticks as plain numbers without minor labels (the default '3x10^0' labels overlap)."""
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(StrMethodFormatter("{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "_", text).strip("_").lower()


def render_plots(doc: Mapping[str, Any]) -> dict[str, bytes]:
    """All plots of the report as PNG bytes keyed by file name (only those with data to show)."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe when a GUI backend was chosen before
    plots: dict[str, bytes | None] = {
        "hidden_hist.png": _plot_hidden_hist(doc),
        "crest_kurtosis.png": _plot_crest_kurtosis(doc),
    }
    primary = doc["timing"]["latency"].get("primary_tokens")
    for rt in _runtimes_with_cases(doc):
        if primary is not None:
            plots[f"scatter_{_slug(rt)}.png"] = _plot_scatter(doc, rt, int(primary))
        plots[f"latency_tokens_{_slug(rt)}.png"] = _plot_latency_tokens(doc, rt)
    return {k: v for k, v in plots.items() if v is not None}
