"""Runtime adapters (onnxruntime, torch, bitsandbytes) behind one small protocol; see `base`."""

from __future__ import annotations

from .base import (
    FORMATS,
    RUNTIMES,
    Availability,
    Compute,
    Format,
    Loaded,
    ModelCase,
    Runtime,
    available_runtimes,
    get_format,
    get_runtime,
    parse_formats,
    runtime_names,
)

__all__ = [
    "FORMATS",
    "RUNTIMES",
    "Availability",
    "Compute",
    "Format",
    "Loaded",
    "ModelCase",
    "Runtime",
    "available_runtimes",
    "get_format",
    "get_runtime",
    "parse_formats",
    "runtime_names",
]
