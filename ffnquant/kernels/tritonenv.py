"""What ffnquant's Triton kernel modules share: triton imported lazily with a one-line error, and whether Triton's
interpreter (TRITON_INTERPRET=1: CPU tensors, numpy semantics) is on.

Kernel bodies resolve `tl` from their own module's globals, so each kernel module keeps `triton` / `tl` globals
and fills them from `import_triton` on first use; kernels are decorated per mode at first launch (triton.jit
picks compiled or interpreted when it decorates), so the variable may be set any time before that.
"""

from __future__ import annotations

import math
import os
import types
from typing import Any, Callable, Sequence

from ..errors import FFNQuantError

__all__ = ["interpreting", "import_triton", "jit_per_mode", "time_call", "fastest"]


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter."""
    try:  # triton >= 3.4 reads the variable through knobs (accepts 1/true/on)
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:
        return os.environ.get("TRITON_INTERPRET", "") in ("1", "true", "on")


def import_triton(what: str):
    """(triton, triton.language), or an error saying that `what` needs triton and why it fails to import."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # not installed, or broken (missing libraries)
        raise FFNQuantError(f"{what} needs triton, which fails to import: {exc}") from exc
    return triton, tl


def jit_per_mode(triton: Any, module_globals: dict[str, Any], helpers: Sequence[Callable[..., Any]] = ()):
    """A `jit(fn, **options)` for one mode (compiled or interpreted, whichever is on now) whose kernels may call
    `helpers` (plain functions written as Triton code): each is decorated for this mode in a copy of the module's
    globals, and kernels decorated by the returned `jit` resolve helper names there. triton.jit binds a function to
    the mode of its decoration, so one set of helpers decorated at import would serve only one of the two."""
    scope = dict(module_globals)

    def jit(fn, **options):
        copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        copy.__module__, copy.__qualname__ = fn.__module__, fn.__qualname__
        copy.__annotations__ = dict(fn.__annotations__)
        return triton.jit(copy, **options)

    for helper in helpers:
        scope[helper.__name__] = jit(helper)
    return jit


def time_call(fn: Callable[[], Any]) -> float:
    """GPU milliseconds of one call replayed from a CUDA graph, L2 flushed before each replay.

    Timing the eager call instead would mostly measure Python launch overhead: a decode-size call is a
    few microseconds of GPU time, far less than the wrapper's and Triton's host-side cost.
    """
    import torch
    from triton.testing import do_bench

    fn()  # compile outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=3, rep=15)


def fastest(candidates: Sequence[Any], launch: Callable[[Any], Any], what: str) -> Any:
    """The candidate config whose `launch(config)` replays fastest (`time_call`); configs the compiler rejects on
    this device are skipped, and an error naming `what` is raised when none compiles."""
    best, best_ms, errors = None, math.inf, []
    for cfg in candidates:
        try:
            ms = time_call(lambda: launch(cfg))
        except Exception as exc:  # a config the compiler rejects here (resources): skip it
            text = str(exc).strip()
            errors.append(f"{cfg}: {text.splitlines()[0] if text else type(exc).__name__}")
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise FFNQuantError(f"no {what} config compiles: {errors[0]}")
    return best
