"""Runtime adapters (onnxruntime, torch, bitsandbytes) behind one small protocol; see `base`.

Importing this package declares every runtime in the backend registry (`ffnquant.backends`): asked about a recipe,
a runtime answers with `Runtime.serves` of one adapter per name (its formats probed once).
"""

from __future__ import annotations

from typing import Any

from .. import backends

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

_ADAPTERS: dict[str, Runtime] = {}


def _serves(name: str):
    def decide(recipe: Any, spec: Any) -> tuple[str | None, str]:
        if name not in _ADAPTERS:
            _ADAPTERS[name] = get_runtime(name)
        return _ADAPTERS[name].serves(backends.supports_subject(recipe))

    return decide


for _name in RUNTIMES:
    backends.register_backend(_name, f"the {_name} runtime: the kernel that serves a recipe", _serves(_name))
