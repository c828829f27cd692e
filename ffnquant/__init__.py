"""ffnquant: quantization and deployment toolkit for transformer feed-forward layers.

The Python API (`ffnquant.api`): `quantize(layer_or_spec, recipe, calibration)` -> `QuantizedFFN`,
`export_onnx(q, path)`, `evaluate(q, tokens)`, `profile(model_or_spec, tokens)`, `run(config)`.

The quantization stage lives in `ffnquant.quantization` and the run job in `ffnquant.pipeline`,
so no module shares its name with a verb.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import FFNQuantError
from .spec import FFNSpec, Variant, Activation, SITES, WEIGHTS, parse_variant, parse_variants
from .model import FFN, build, save_weights, load_weights
from .recipe import Recipe

from .api import QuantizedFFN, evaluate, export_onnx, profile, quantize, run

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
    "Recipe",
    "QuantizedFFN",
    "quantize",
    "export_onnx",
    "evaluate",
    "profile",
    "run",
]
