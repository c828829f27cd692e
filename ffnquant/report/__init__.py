"""The run report: `report.json` (schema-versioned), `report.md` and a self-contained `report.html`.

Everything here renders a report *document* (a JSON-able dict, see
`ffnquant/data/report.schema.json`) built by `ffnquant.pipeline`; nothing is measured here.
Plots, Markdown and HTML are all produced in memory first and only then written, each file
atomically, so a failure while rendering leaves no report behind and an interruption while
writing leaves whole files only.

Determinism: equal seeds and inputs give equal documents except under `timing` (latency,
recommendations ranked by latency, wall times) and `environment.timestamp_utc`;
`strip_timing` removes exactly those.
"""

from __future__ import annotations

import copy
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from ..infra.atomic import ensure_writable_dir, write_bytes, write_json, write_text
from ..errors import FFNQuantError
from .html import render_html
from .markdown import PLOT_DIR, render_markdown
from .plots import render_plots

__all__ = [
    "SCHEMA_NAME",
    "SCHEMA_VERSION",
    "PLOT_DIR",
    "report_schema",
    "validate_report",
    "strip_timing",
    "render_plots",
    "render_markdown",
    "render_html",
    "write_report",
]

SCHEMA_NAME = "ffnquant-report"
SCHEMA_VERSION = 1


# --- schema ------------------------------------------------------------------------------

def report_schema() -> dict[str, Any]:
    """The JSON Schema of `report.json` (shipped as package data)."""
    text = resources.files("ffnquant").joinpath("data/report.schema.json").read_text(encoding="utf-8")
    return json.loads(text)


def validate_report(doc: Mapping[str, Any]) -> None:
    """Check `doc` against the schema; raise FFNQuantError naming the first violation.

    Needs the `jsonschema` package (the test extra); it is not needed to write reports.
    """
    try:
        import jsonschema
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise FFNQuantError("validating a report needs the jsonschema package (pip install '.[test]' from the ffnquant checkout)") from exc
    validator = jsonschema.Draft202012Validator(report_schema())
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        raise FFNQuantError(f"report does not match schema v{SCHEMA_VERSION} at {where}: {err.message}")


def strip_timing(doc: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `doc` without the clock-dependent parts, for comparing two runs."""
    out = copy.deepcopy(dict(doc))
    out.pop("timing", None)
    if isinstance(out.get("environment"), dict):
        out["environment"].pop("timestamp_utc", None)
    return out


# --- writing -------------------------------------------------------------------------------

def write_report(doc: Mapping[str, Any], out_dir: str | os.PathLike, stem: str = "report") -> dict[str, Path]:
    """Render everything in memory, then write `<stem>.json/.md/.html` and the plot PNGs atomically.

    Returns the written paths by kind ("json", "md", "html", "plot:<name>").
    """
    # Fail before writing anything: JSON-able without NaN, then plots, Markdown and HTML.
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise FFNQuantError(f"report document is not valid JSON: {exc}") from exc
    plots = render_plots(doc)
    md_text = render_markdown(doc, plots)
    html_text = render_html(md_text, plots, title=f"ffnquant report: {doc['command']}")
    out = ensure_writable_dir(out_dir)
    paths: dict[str, Path] = {}
    if plots:
        ensure_writable_dir(out / PLOT_DIR)
    for name, data in plots.items():
        paths[f"plot:{name}"] = write_bytes(out / PLOT_DIR / name, data)
    paths["json"] = write_json(out / f"{stem}.json", doc)
    paths["md"] = write_text(out / f"{stem}.md", md_text)
    paths["html"] = write_text(out / f"{stem}.html", html_text)
    return paths
