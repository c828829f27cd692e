"""ffnquant: quantization and deployment toolkit for transformer feed-forward layers.

The Python API (`ffnquant.api`): `quantize(layer_or_spec, recipe, calibration)` -> `QuantizedFFN`,
`export_onnx(q, path)`, `evaluate(q, tokens)`, `profile(model_or_spec, tokens)`, `run(config)`.

Two of these verbs share their name with a module: `ffnquant.quantize` and `ffnquant.run` are the
FUNCTIONS. The quantization module is imported by its full name (`from ffnquant.quantize import
quantize_spec`, which reads sys.modules and is unaffected); `import ffnquant.quantize as m` or
`from ffnquant import quantize` give the function. The run job lives in `ffnquant.pipeline`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from .errors import FFNQuantError
from .spec import FFNSpec, Variant, Activation, SITES, WEIGHTS, parse_variant, parse_variants
from .model import FFN, build, save_weights, load_weights
from .recipe import Recipe

# Last: binding `quantize` here replaces the attribute that importing the `.quantize` submodule set.
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
