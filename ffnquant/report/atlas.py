"""The layer atlas rendered: heatmaps of layers x sites (PNG) and a Markdown section, from `atlas.layer_atlas`'s dict.

`atlas_ranges.png` holds log10 crest factor, log10 kurtosis and the outlier channel counts, with an optional plan
panel beside them (the recipe chosen per layer and site); `atlas_top.png` holds log10 absmax and, when positions
were measured, the share of the top magnitudes at position 0. Nothing here measures anything.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from ..infra.atomic import ensure_writable_dir, write_bytes, write_text
from ..errors import FFNQuantError, unknown_choice
from ..infra.render import fmt, markdown_table
from .plots import png

__all__ = ["ATLAS_FILES", "plan_grid", "render_atlas_plots", "atlas_markdown", "write_atlas"]

ATLAS_FILES = {"json": "atlas.json", "markdown": "atlas.md", "ranges": "atlas_ranges.png", "top": "atlas_top.png"}
# Cells are annotated while the text still fits: up to this many layers (rows) and sites (columns).
ANNOTATE_MAX_ROWS = 48
ANNOTATE_MAX_COLS = 8
_ROW_IN = 0.27  # inches per layer row
_COL_IN = 0.72  # inches per site column


def _check(atlas: Mapping[str, Any]) -> None:
    if not isinstance(atlas, Mapping) or not atlas.get("layers"):
        raise FFNQuantError("the atlas holds no layers")


def plan_grid(atlas: Mapping[str, Any], plan: Mapping[int, Mapping[str, str]] | None) -> list[dict[str, str]]:
    """The plan as the atlas's rows: per layer row, site -> recipe label (empty without a plan). Layer indices the
    atlas lacks and sites the layers lack are refused, naming the valid ones."""
    _check(atlas)
    rows = atlas["layers"]
    if not plan:
        return [{} for _ in rows]
    indices = sorted({r["index"] for r in rows if r["index"] is not None})
    for index, sites in plan.items():
        if index not in indices:
            raise unknown_choice("plan layer index", index, indices)
        if not isinstance(sites, Mapping):
            raise FFNQuantError(f"plan layer {index}: expected site -> recipe label, got {type(sites).__name__}")
        for site, label in sites.items():
            if site not in atlas["sites"]:
                raise unknown_choice(f"plan site of layer {index}", site, atlas["sites"])
            if not isinstance(label, str) or not label.strip():
                raise FFNQuantError(f"plan layer {index} site {site}: the recipe label must be a non-empty string")
    return [{s: str(v).strip() for s, v in plan.get(r["index"], {}).items()} if r["index"] is not None else {}
            for r in rows]


def _matrix(atlas: Mapping[str, Any], value) -> list[list[float]]:
    out = []
    for r in atlas["layers"]:
        row = []
        for s in atlas["sites"]:
            cell = r["sites"].get(s)
            v = value(cell) if cell else None
            row.append(float("nan") if v is None else float(v))
        out.append(row)
    return out


def _short(v: float) -> str:
    """A cell's number in at most 5 characters: 3.1, 47, 812, 1.2e4."""
    if v != v:
        return ""
    if abs(v) >= 1000:
        mantissa, exponent = f"{v:.1e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{v:.0f}" if abs(v) >= 9.95 else f"{v:.1f}"


def _heatmap(ax, fig, atlas, matrix, shown, title, cmap, annotate, vmin=None, vmax=None, cbar=""):
    import matplotlib
    import numpy as np

    data = np.ma.masked_invalid(np.array(matrix, dtype=float))
    cm = matplotlib.colormaps[cmap].with_extremes(bad="#d9d9d9")  # grey: a site the layer does not have
    im = ax.imshow(data, aspect="auto", cmap=cm, vmin=vmin, vmax=vmax, interpolation="nearest")
    bar = fig.colorbar(im, ax=ax, fraction=0.08, pad=0.03)
    bar.ax.tick_params(labelsize=7)
    if cbar:
        bar.set_label(cbar, fontsize=7)
    _axes(ax, atlas, title)
    if annotate:
        lo, hi = im.norm.vmin, im.norm.vmax
        for i, row in enumerate(matrix):
            for j, v in enumerate(row):
                if v != v:
                    continue
                level = (v - lo) / (hi - lo) if hi > lo else 0.5
                rgba = cm(max(0.0, min(1.0, level)))
                light = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2] > 0.5
                ax.text(j, i, shown[i][j], ha="center", va="center", fontsize=6.5,
                        color="black" if light else "white")


def _axes(ax, atlas, title, lines="white"):
    ax.set_title(title, fontsize=9)
    ax.set_xticks(range(len(atlas["sites"])), atlas["sites"], rotation=35, ha="right", fontsize=8)
    ax.set_yticks(range(len(atlas["layers"])), [r["label"] for r in atlas["layers"]], fontsize=7)
    n_rows, n_cols = len(atlas["layers"]), len(atlas["sites"])
    # two line collections, not minor ticks: a grid of ticks costs seconds to lay out on a 30-layer atlas
    ax.vlines([x + 0.5 for x in range(n_cols - 1)], -0.5, n_rows - 0.5, colors=lines, lw=0.6)
    ax.hlines([y + 0.5 for y in range(n_rows - 1)], -0.5, n_cols - 0.5, colors=lines, lw=0.6)


def _plan_panel(ax, atlas, grid, annotate):
    import matplotlib
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    labels = sorted({v for row in grid for v in row.values()})
    palette = matplotlib.colormaps["tab20" if len(labels) > 10 else "tab10"]
    colours = [palette(i % palette.N) for i in range(len(labels))]
    codes = np.full((len(grid), len(atlas["sites"])), np.nan)
    for i, row in enumerate(grid):
        for j, s in enumerate(atlas["sites"]):
            if s in row:
                codes[i, j] = labels.index(row[s])
    cm = ListedColormap(colours or ["white"]).with_extremes(bad="white")  # no recipe planned for this cell
    ax.imshow(np.ma.masked_invalid(codes), aspect="auto", cmap=cm, vmin=-0.5, vmax=max(len(labels), 1) - 0.5,
              interpolation="nearest")
    _axes(ax, atlas, "plan: recipe per site", lines="#bbbbbb")
    if annotate:
        for i, row in enumerate(grid):
            for j, s in enumerate(atlas["sites"]):
                if s in row:
                    ax.text(j, i, row[s], ha="center", va="center", fontsize=5.5, color="black")
    ax.legend(handles=[Patch(facecolor=c, label=lab) for c, lab in zip(colours, labels)], loc="upper left",
              bbox_to_anchor=(1.02, 1.0), fontsize=7, frameon=False, title="recipe", title_fontsize=7)


def render_atlas_plots(atlas: Mapping[str, Any], plan: Mapping[int, Mapping[str, str]] | None = None) -> dict[str, bytes]:
    """PNG bytes: 'ranges' (log10 crest factor, log10 kurtosis, outlier channels; the plan panel when given) and
    'top' (log10 absmax; the share of the top magnitudes at position 0 when positions were measured)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    _check(atlas)
    grid = plan_grid(atlas, plan)
    n_rows, n_cols = len(atlas["layers"]), len(atlas["sites"])
    annotate = n_rows <= ANNOTATE_MAX_ROWS and n_cols <= ANNOTATE_MAX_COLS
    height = max(3.2, _ROW_IN * n_rows + 1.9)
    panel_w = max(2.6, _COL_IN * n_cols + 1.1)
    k_lo, k_hi = (f"{k:g}" for k in atlas["outlier_ks"][:2])
    planned = any(grid)

    n_panels = 3 + planned
    fig, axes = plt.subplots(1, n_panels, figsize=(panel_w * n_panels, height), squeeze=False)
    axes = axes[0]
    crest = _matrix(atlas, lambda c: c["crest_factor"])
    kurt = _matrix(atlas, lambda c: c["kurtosis"])
    outl = _matrix(atlas, lambda c: c["outlier_channels"][k_lo])
    outl_hi = _matrix(atlas, lambda c: c["outlier_channels"][k_hi])

    def logs(m):
        return [[math.log10(v) if v == v and v > 0 else float("nan") for v in row] for row in m]

    _heatmap(axes[0], fig, atlas, logs(crest), [[_short(v) for v in row] for row in crest],
             "crest factor (absmax / std)", "viridis", annotate, cbar="log10")
    # Pearson kurtosis is 3 for a Gaussian: the colour scale starts there
    _heatmap(axes[1], fig, atlas, logs(kurt), [[_short(v) for v in row] for row in kurt],
             "kurtosis (Pearson, 3 = Gaussian)", "magma", annotate, vmin=math.log10(3.0), cbar="log10")
    shown = [[("" if a != a else f"{a:.0f}/{b:.0f}") for a, b in zip(ra, rb)] for ra, rb in zip(outl, outl_hi)]
    _heatmap(axes[2], fig, atlas, outl, shown, f"outlier channels (>{k_lo}x / >{k_hi}x median)", "Blues", annotate,
             vmin=0, cbar=f"channels > {k_lo}x")
    if planned:
        _plan_panel(axes[3], atlas, grid, annotate)
    fig.suptitle("layer atlas: how hard each layer's ranges are, per site", fontsize=10)
    fig.tight_layout()
    out = {"ranges": png(fig)}

    share = _matrix(atlas, lambda c: 100.0 * c["positions"]["position0_share"] if c.get("positions") else None)
    measured = atlas.get("positions_measured", False)
    fig, axes = plt.subplots(1, 1 + measured, figsize=(panel_w * (1 + measured), height), squeeze=False)
    axes = axes[0]
    absmax = _matrix(atlas, lambda c: c["absmax"])
    _heatmap(axes[0], fig, atlas, logs(absmax), [[_short(v) for v in row] for row in absmax], "absmax |x|",
             "cividis", annotate, cbar="log10")
    if measured:
        pct = f"{100 * atlas['top_fraction']:g}%"
        _heatmap(axes[1], fig, atlas, share, [["" if v != v else f"{v:.0f}" for v in row] for row in share],
                 f"top {pct} |x| at position 0 (%)", "Reds", annotate, vmin=0, vmax=100, cbar="%")
    fig.suptitle("where the largest values are", fontsize=10)
    fig.tight_layout()
    out["top"] = png(fig)
    return out


def _where(cell: Mapping[str, Any]) -> str:
    pos = cell.get("positions")
    if not pos or not pos["top"]:
        return "-"
    t = pos["top"][0]
    return f"{t['value']:.4g} at seq {t['sequence']}, pos {t['position']}, ch {t['channel']}"


def atlas_markdown(atlas: Mapping[str, Any], plots: Mapping[str, str] | None = None,
                   plan: Mapping[int, Mapping[str, str]] | None = None, heading_level: int = 1,
                   measured_on: str | None = None) -> str:
    """The atlas's Markdown section: the worst layers per site, recurring channels, where the top values sit, the
    position-0 share, the plan's recipes beside their layers' figures, and the images (`plots`: key -> file name)."""
    _check(atlas)
    grid = plan_grid(atlas, plan)
    h = "#" * heading_level
    rows, sites = atlas["layers"], atlas["sites"]
    lines = [f"{h} Layer atlas", ""]
    lines.append(f"{len(rows)} layer(s) x {len(sites)} site(s). Crest factor = absmax/std; kurtosis is Pearson's "
                 f"(3 for a Gaussian); outlier channels have absmax above "
                 f"{' / '.join(f'{k:g}x' for k in atlas['outlier_ks'])} the median channel's.")
    if measured_on:
        lines += ["", f"Token positions: {measured_on}"]
    elif not atlas.get("positions_measured"):
        lines += ["", "Token positions were not measured."]
    if plots:
        titles = {"ranges": "crest factor, kurtosis and outlier channels per layer and site",
                  "top": "absmax and the position-0 share of the top magnitudes"}
        lines += [""] + [f"![{titles.get(k, k)}]({p})" for k, p in plots.items()]

    lines += ["", f"{h}# Standouts", "",
              f"Layers whose absmax at a site is at least {atlas['standout_ratio']:g}x the median layer's there "
              "(the largest value's channel, and its position when measured):", ""]
    body = [[f"`{s}`", d["label"], d["absmax"], f"{d['ratio']:.0f}x", d["crest_factor"], d["kurtosis"], d["channel"],
             "-" if d["position"] is None else d["position"],
             "-" if d["position0_share"] is None else f"{100 * d['position0_share']:.0f}%"]
            for s in sites for d in atlas["standouts"][s]]
    lines.append(markdown_table(["site", "layer", "absmax", "x median", "crest", "kurtosis", "channel", "position",
                                 f"top {100 * (atlas['top_fraction'] or 0):g}% at pos. 0"], body)
                 if body else "No layer stands out.")
    lines += ["", f"{h}# Hardest layers per site", ""]
    table = []
    for s in sites:
        w = atlas["worst"][s]
        table.append([f"`{s}`", ", ".join(f"{d['label']} ({fmt(d['value'], 3)})" for d in w["crest_factor"]),
                      ", ".join(f"{d['label']} ({fmt(d['value'], 3)})" for d in w["kurtosis"])])
    lines.append(markdown_table(["site", "crest factor", "kurtosis"], table))

    lines += ["", f"{h}# Where the largest values sit", ""]
    rec = atlas.get("recurring_channels", {})
    lines.append("Channels among a layer's top channels by absmax (above "
                 f"{atlas['outlier_ks'][0]:g}x the median channel) in more than one layer, at the d_model-wide sites "
                 "(the residual stream's channels; a d_ff site's channel ids are each layer's own neurons):")
    lines.append("")
    rec_rows = [[f"`{s}`", d["channel"], len(d["layers"]), ", ".join(d["layers"]), d["max_absmax"]]
                for s, found in rec.items() for d in found[:8]]
    lines.append(markdown_table(["site", "channel", "layers", "which", "largest absmax"], rec_rows) if rec_rows
                 else "No channel recurs across layers.")
    lines += ["", "Per layer: the largest value (and, when positions were measured, its sequence, position and "
              "channel) and the top channels by absmax (x median channel absmax):", ""]
    for s in sites:
        body = []
        for r in rows:
            cell = r["sites"].get(s)
            if not cell:
                continue
            chans = ", ".join(f"{c['channel']} ({fmt(c['ratio'], 3)}x)" for c in cell["top_channels"][:3])
            body.append([r["label"], cell["absmax"], _where(cell), chans])
        lines += [f"**`{s}`**", "", markdown_table(["layer", "absmax", "largest value", "top channels"], body), ""]

    if atlas.get("positions_measured"):
        pct = f"{100 * atlas['top_fraction']:g}%"
        lines += [f"{h}# Position 0", "",
                  f"Share of each site's top {pct} magnitudes at position 0 of their sequence (by chance: "
                  "one token per sequence, the baseline column):", ""]
        body = []
        for r in rows:
            cells = [r["sites"].get(s, {}).get("positions") for s in sites]
            base = next((c["position0_baseline"] for c in cells if c), None)
            body.append([r["label"]] + [f"{100 * c['position0_share']:.0f}% ({c['position0']}/{c['top_count']})"
                                        if c else "-" for c in cells] + [f"{100 * base:.1f}%" if base else "-"])
        lines += [markdown_table(["layer"] + [f"`{s}`" for s in sites] + ["baseline"], body), ""]

    if any(grid):
        lines += [f"{h}# Plan", "", "The recipe the plan chose per layer and site, beside the site's figures "
                  "(crest factor / kurtosis):", ""]
        body = []
        for r, row in zip(rows, grid):
            for s in sites:
                if s in row:
                    cell = r["sites"].get(s, {})
                    body.append([r["label"], f"`{s}`", row[s], cell.get("crest_factor"), cell.get("kurtosis")])
        lines += [markdown_table(["layer", "site", "recipe", "crest", "kurtosis"], body), ""]
    return "\n".join(lines).rstrip() + "\n"


def write_atlas(atlas: Mapping[str, Any], out_dir: str | os.PathLike,
                plan: Mapping[int, Mapping[str, str]] | None = None, meta: Mapping[str, Any] | None = None) -> dict[str, Path]:
    """Write atlas.json, atlas.md and the PNGs into `out_dir`; rendered and validated in memory first, each file
    written atomically (inside an `OutputTransaction` folder, the whole set moves into place together)."""
    _check(atlas)
    meta = dict(meta or {})
    plots = render_atlas_plots(atlas, plan)
    doc = {"meta": meta, "plan": {str(k): dict(v) for k, v in (plan or {}).items()},
           "plots": {k: ATLAS_FILES[k] for k in plots}, **atlas}
    try:
        text = json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n"
    except ValueError as exc:
        raise FFNQuantError(f"the atlas has a non-finite number: {exc}") from exc
    markdown = atlas_markdown(atlas, {k: ATLAS_FILES[k] for k in plots}, plan, measured_on=meta.get("positions_measured_on"))
    folder = ensure_writable_dir(out_dir)
    paths = {k: write_bytes(folder / ATLAS_FILES[k], blob) for k, blob in plots.items()}
    paths["json"] = write_text(folder / ATLAS_FILES["json"], text)
    paths["markdown"] = write_text(folder / ATLAS_FILES["markdown"], markdown)
    return paths
