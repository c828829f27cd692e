"""ffnquant: quantization and deployment toolkit for transformer feed-forward layers."""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import FFNQuantError
from .spec import FFNSpec, Variant, Activation, SITES, WEIGHTS, parse_variant, parse_variants
from .model import FFN, build, save_weights, load_weights

__all__ = [
    "__version__",
    "FFNQuantError",
    "FFNSpec",
    "Variant",
    "Activation",
    "SITES",
    "WEIGHTS",
    "parse_variant",
    "parse_variants",
    "FFN",
    "build",
    "save_weights",
    "load_weights",
]
