"""ffnquant: quantization and deployment toolkit for transformer feed-forward layers.

The Python API (`ffnquant.api`): `quantize(layer_or_spec, recipe, calibration)` -> `QuantizedFFN`,
`export_onnx(q, path)`, `evaluate(q, tokens)`, `profile(model_or_spec, tokens)`, `run(config)`; whole models
(`ffnquant.wholemodel`): `plan(model, target)` -> Plan, `apply(model, plan_or_recipe)` -> the quantized model,
`save(qmodel, out)` -> DeployReport, on a model folder or a transformers model.

The quantization stage lives in `ffnquant.quantization`, the run job in `ffnquant.pipeline` and the per-layer
planning in `ffnquant.planning`, so no module shares its name with a verb.
"""

from __future__ import annotations

__version__ = "0.1.0"

import os as _os

# MKL (torch's CPU BLAS) picks its code path per call from the buffers' memory alignment unless told otherwise, so
# one float32 matmul rounds differently from run to run: measured on this project's CPU, `quantize --model
# smollm2-135m --scheme w8a8` gave a final hidden SQNR of 7.68 or 7.86 dB from one run to the next, and a plan's
# verification took one round or two. Conditional numerical reproducibility, set before torch loads MKL, makes the
# same run give the same figures (3 of 3 runs equal); a caller's own setting is kept.
_os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from .errors import FFNQuantError  # noqa: E402

# The rest load on first use (PEP 562): `import ffnquant` (which the `ffnquant` command does first) must not
# import torch, so that a Ctrl-C at start-up reaches `cli.main`, which reports it in one line.
_LAZY = {
    "FFNSpec": "spec", "Variant": "spec", "Activation": "spec", "SITES": "spec", "WEIGHTS": "spec",
    "parse_variant": "spec", "parse_variants": "spec",
    "FFN": "model", "build": "model", "save_weights": "model", "load_weights": "model",
    "Recipe": "recipe",
    "QuantizedFFN": "api", "quantize": "api", "export_onnx": "api", "evaluate": "api", "profile": "api", "run": "api",
    "plan": "wholemodel", "apply": "wholemodel", "save": "wholemodel",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ffnquant' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


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
    "plan",
    "apply",
    "save",
]
