"""The typed results the run's stages hand to each other, and the run's own result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .config import RunConfig

__all__ = ["Progress", "RunResult", "Stages", "VariantResult", "ModelPart", "json_num"]

# (message, done, total): called after each unit of work; the CLI draws a progress bar from it.
Progress = Callable[[str, int, int], None]


def json_num(x: Any) -> float | None:
    """A float for the JSON report: None for missing, infinite or NaN values (JSON has no inf)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


class Stages:
    """Wall time per named stage (for the report's timing section)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


@dataclass
class VariantResult:
    """Every recipe of one FFN (a variant or a model's layer): accuracy rows, artifacts written (staged
    paths), the artifact of each recipe by recipe name, onnxruntime's default static baseline, and the
    quantized FFNs kept for an end-to-end run."""

    rows: list[dict]
    artifacts: list[dict]
    paths: dict[str, Path]
    ort_baseline: dict | None
    kept: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelPart:
    """The real model's part of the run: its report section, range tables, rows and latency."""

    doc: dict[str, Any]
    tables: dict[str, Any]
    rows: list[dict]
    artifacts: list[dict]
    baselines: list[dict]
    latency: dict[str, Any]


@dataclass
class RunResult:
    """The report document of a run and the files written."""

    config: RunConfig
    document: dict[str, Any]
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def recommendations(self) -> list[dict[str, Any]]:
        return self.document["timing"]["recommendations"]

    @property
    def primary_tokens(self) -> int | None:
        return self.document["timing"]["latency"].get("primary_tokens")
