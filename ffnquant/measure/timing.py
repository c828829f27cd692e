"""Timing one call: wall-clock and CUDA-event timers, and the device copy bandwidth a roofline falls back on.

The primitives under `ffnquant.bench`'s measuring loop; nothing here knows about runtimes' formats or sweeps.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    from ..runtimes.base import Loaded, Runtime

__all__ = ["Timer", "WallTimer", "CudaEventTimer", "default_timer", "TimerFactory", "time_calls", "measure_copy_bandwidth"]


# --- timers -------------------------------------------------------------------------------
class Timer(Protocol):
    """Times one call: `start()` before it, `stop()` after it returns the seconds it took."""

    def start(self) -> None: ...

    def stop(self) -> float: ...


class WallTimer:
    """perf_counter around the call, after synchronising the device (so queued work is counted)."""

    def __init__(self, synchronize: Callable[[], None] = lambda: None) -> None:
        self._sync = synchronize
        self._t0 = 0.0

    def start(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self._t0


class CudaEventTimer:
    """CUDA events on torch's current stream: device time of the work queued between start and stop."""

    def __init__(self) -> None:
        import torch

        self._begin = torch.cuda.Event(enable_timing=True)
        self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self._begin.record()

    def stop(self) -> float:
        self._end.record()
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1e3


def default_timer(runtime: "Runtime", loaded: "Loaded") -> Timer:
    """CUDA events for torch-based CUDA runtimes, else wall time with synchronisation."""
    if getattr(runtime, "timing", "wall") == "cuda-events":
        return CudaEventTimer()
    return WallTimer(lambda: runtime.synchronize(loaded))


TimerFactory = Callable[["Runtime", "Loaded"], Timer]


def time_calls(fn: Callable[[], object], repeats: int, warmup: int = 0, timer: Timer | None = None) -> list[float]:
    """Seconds of each of `repeats` calls of `fn` after `warmup` untimed ones (wall time unless `timer` is given).

    The fixed-count loop beside `bench.measure`'s budgeted one, for callers outside the runtime adapters
    (an onnxruntime session, a torch module, rounds interleaved across sessions)."""
    timer = timer if timer is not None else WallTimer()
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        timer.start()
        fn()
        samples.append(timer.stop())
    return samples


def time_within_budget(fn: Callable[[], object], budget_s: float, min_repeats: int, max_repeats: int,
                       timer: Timer | None = None) -> list[float]:
    """Seconds of single calls of `fn`, timed until `budget_s` of timed calls (at least `min_repeats`, at most
    `max_repeats`): the bench's loop, beside `time_calls`' fixed count.

    A wall-clock cap (3x the budget + 1 s) keeps a case bounded when the timer counts less than the loop costs
    (CUDA events exclude launch gaps); the repeat floor keeps percentiles meaningful."""
    timer = timer if timer is not None else WallTimer()
    samples: list[float] = []
    total = 0.0
    wall0 = time.perf_counter()
    wall_cap = 3 * budget_s + 1.0
    while True:
        timer.start()
        fn()
        dt = timer.stop()
        samples.append(dt)
        total += dt
        n = len(samples)
        if n >= max_repeats:
            break
        if n >= min_repeats and (total >= budget_s or time.perf_counter() - wall0 >= wall_cap):
            break
    return samples


# --- the roofline's bandwidth where no peak is tabled ---------------------------------------
def measure_copy_bandwidth(device: str = "cpu", nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best-of-`repeats` device copy bandwidth in bytes/s (read + write counted, as STREAM's copy does)."""
    import torch

    n = max(1, nbytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(repeats + 1):  # the first copy faults the pages in
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best
