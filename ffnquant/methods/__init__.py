"""Weight-quantization methods: a registry of handlers, each turning a float weight into a `QuantizedLinear`.

`handler_for(scheme)` is the handler of a scheme's method; `quantize_linear(weight, scheme, hessian)` runs it.
The built-in handlers (round-to-nearest, bitsandbytes' nf4/fp4, GPTQ, HQQ, AWQ) are in `builtin`; a new
method is one such file plus a preset (`schemes.register_preset`), see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import builtin  # noqa: F401  (registers the built-in handlers)
from .qlinear import QuantizedLinear, WeightGrid, signed_zero_point
from .registry import (MethodHandler, get_handler, handler_for, is_method, method_names, register_method,
                       unregister_method)

if TYPE_CHECKING:  # annotations only
    from ..schemes import Scheme

__all__ = ["MethodHandler", "QuantizedLinear", "WeightGrid", "signed_zero_point", "register_method",
           "unregister_method", "get_handler", "handler_for", "is_method", "method_names", "quantize_linear"]


def quantize_linear(weight: Any, scheme: Scheme, hessian: Any = None) -> QuantizedLinear:
    """`weight` [out, in] quantized under `scheme` by its method's handler."""
    return handler_for(scheme).quantize(weight, scheme, hessian)
