"""The registry of weight-quantization method handlers: a method's name -> the handler that quantizes under it.

A handler turns one float weight into a `QuantizedLinear` (`ffnquant.methods.qlinear`) under a `Scheme`; the
fake-quant forward, the ONNX writers and the deployment formats all read that object, so a method is added
once, here, and every consumer takes it. This module is the leaf every other one may import: it holds the
table and the protocol, and imports nothing of ffnquant but its errors (the built-in handlers register
themselves the first time the table is read: `schemes` finds a scheme's handler here without importing any
handler, so the handlers, which stand on the math in `numerics`, sit above `schemes` with no import loop).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import FFNQuantError, unknown_choice

if TYPE_CHECKING:  # annotations only
    import torch

    from ..schemes import Scheme
    from .qlinear import QuantizedLinear

__all__ = ["MethodHandler", "register_method", "unregister_method", "get_handler", "handler_for",
           "method_names", "is_method", "quantize_linear"]


class MethodHandler:
    """How one rounding method quantizes a weight. Subclass it, set `method` (the name a Scheme's `method`
    holds), override `quantize`, and pass an instance to `register_method`.

    - `accepts(scheme)`: whether this handler serves that scheme of its method (the bitsandbytes formats are
      method rtn on their own code books, so their handler accepts nf4/fp4 and the plain one the rest).
    - `check(scheme)`: why a Scheme naming this method is invalid, or None; run when a Scheme is built.
    - `needs_hessians`: the handler reads the input Hessians H = sum X^T X of calibration data.
    - `on_grid`: every weight it returns lies on the scheme's integer grid (`QuantizedLinear.codes` set), so
      any writer that stores codes and scales stores it.
    - `fold(model, scheme, hessians, weights)`: an exact float rewrite of the whole FFN before its weights are
      quantized (AWQ's searched channel scales); returns (model, remedy records). Default: a copy, no record.
    """

    method: str = ""
    needs_hessians: bool = False
    on_grid: bool = True
    describe: str = ""

    def accepts(self, scheme: Scheme) -> bool:
        return True

    def check(self, scheme: Scheme) -> str | None:
        return None

    def fold(self, model: Any, scheme: Scheme, hessians: Mapping[str, Any] | None, weights: list[str],
             cache: dict | None = None) -> tuple[Any, list]:
        """The exact float rewrite of the whole FFN before its weights are quantized, and its remedy records (none:
        a copy). `cache`: a dict the caller keeps for one (model, hessians) pair, where a costly search may keep its
        result for the next recipe."""
        import copy

        return copy.deepcopy(model), []

    def quantize(self, weight: "torch.Tensor", scheme: Scheme, hessian: "torch.Tensor | None" = None) -> "QuantizedLinear":
        raise NotImplementedError


# method name -> handlers in registration order (the first that accepts a scheme serves it)
_HANDLERS: dict[str, list[MethodHandler]] = {}
_BUILTIN = "ffnquant.methods.builtin"  # registers the built-in handlers when imported
_builtin_loaded: list[bool] = []  # [True] once the import of the built-in handlers has started


def _with_builtin() -> dict[str, list[MethodHandler]]:
    """The table, the built-in handlers in it: they are imported by name the first time it is read (or written, so
    a handler registered by a user comes after them, as it would have at import time)."""
    if not _builtin_loaded:
        _builtin_loaded.append(True)
        importlib.import_module(_BUILTIN)
    return _HANDLERS



def register_method(handler: MethodHandler, *, first: bool = False) -> MethodHandler:
    """Add `handler` under its `method` name; `first` puts it before the handlers already there (a narrower
    handler of the same method, e.g. a code-book format of rtn). Returns the handler."""
    name = str(handler.method).strip().lower()
    if not name or not name.replace("-", "").replace("_", "").isalnum():
        raise FFNQuantError(f"a method handler needs a name of letters, digits, '-' or '_', got {handler.method!r}")
    handler.method = name
    chain = _with_builtin().setdefault(name, [])
    if handler in chain:
        return handler
    chain.insert(0, handler) if first else chain.append(handler)
    return handler


def unregister_method(handler: MethodHandler) -> None:
    """Remove `handler` (a method with no handler left is no longer a valid name)."""
    chain = _with_builtin().get(handler.method, [])
    if handler in chain:
        chain.remove(handler)
    if not chain:
        _HANDLERS.pop(handler.method, None)


def method_names() -> list[str]:
    """Every registered method name."""
    return list(_with_builtin())


def is_method(name: str) -> bool:
    return str(name).strip().lower() in _with_builtin()


def get_handler(name: str) -> list[MethodHandler]:
    """The handlers of method `name`; an unknown name lists the registered ones."""
    key = str(name).strip().lower()
    if key not in _with_builtin():
        raise unknown_choice("method", name, list(_HANDLERS))
    return list(_HANDLERS[key])


def handler_for(scheme: Scheme) -> MethodHandler:
    """The handler that quantizes `scheme`'s weights: the first of its method's handlers that accepts it."""
    for handler in get_handler(str(scheme.method)):
        if handler.accepts(scheme):
            return handler
    raise FFNQuantError(f"scheme {scheme.name!r}: no {scheme.method} handler takes {scheme.weight_dtype} weights")


def quantize_linear(weight: Any, scheme: Scheme, hessian: Any = None) -> QuantizedLinear:
    """`weight` [out, in] quantized under `scheme` by its method's handler."""
    return handler_for(scheme).quantize(weight, scheme, hessian)
