"""Weight-quantization methods: a registry of handlers, each turning a float weight into a `QuantizedLinear`, and
the torch reference built on them.

`handler_for(scheme)` is the handler of a scheme's method; `quantize_linear(weight, scheme, hessian)` runs it.
The built-in handlers (round-to-nearest, bitsandbytes' nf4/fp4, GPTQ, HQQ, AWQ) are in `builtin`, which the
registry imports by name the first time it is read; AWQ's scale search is `awq`, and `fakequant` is the torch
reference of a quantized FFN (`QuantizedFFN`, `quantize_model`) that installs their `QuantizedLinear`s. They stand
on the math in `numerics` and sit above `schemes`, which finds a handler through the registry alone. A new method
is one handler file plus a preset (`schemes.register_preset`), see docs/ARCHITECTURE.md. This package's own import
loads only the registry and `QuantizedLinear` (never a handler): `schemes` imports it.
"""

from __future__ import annotations

from .qlinear import QuantizedLinear, WeightGrid, signed_zero_point
from .registry import (MethodHandler, get_handler, handler_for, is_method, method_names, quantize_linear,
                       register_method, unregister_method)

__all__ = ["MethodHandler", "QuantizedLinear", "WeightGrid", "signed_zero_point", "register_method",
           "unregister_method", "get_handler", "handler_for", "is_method", "method_names", "quantize_linear"]
