"""Work shared between this process and one spawned helper process, side by side.

For steps that are mostly single-threaded Python (onnxruntime's quantizer is: graph rewriting and calibration
bookkeeping in Python, per layer), a second process uses the core this one leaves idle. This process takes items
from the front of the list while the helper takes them from the back, one at a time, so nothing waits for the
helper's start (importing torch and onnxruntime takes seconds) and neither side idles while the other has work.
The helper is spawned (never forked: a forked copy of a process that has run torch's or OpenMP's threads can hang)
and terminated on every exit path, an exception or Ctrl-C included. Where no helper can be started, this process
does everything, and says nothing differs but the time: the results are the same function of the same inputs.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Callable, Iterator, Sequence

__all__ = ["side_by_side"]


def _init_helper() -> None:
    # Ctrl-C reaches the whole process group: this process stops the helper (`side_by_side`'s finally), which must
    # not print a traceback of its own
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # one core's worth of threads: this process computes on the other
    import torch

    torch.set_num_threads(1)


def side_by_side(fn: Callable[..., Any], items: Sequence[Any], args_of: Callable[[Any], tuple],
                 helper: bool | None = None) -> Iterator[tuple[Any, Any]]:
    """`fn(*args_of(item))` for every item, yielded as (item, result) as each is done: computed in this process and in
    one spawned helper process. `fn` must be a module-level function and its arguments picklable. `helper`: None
    uses one when there are at least two items and two CPUs; False never."""
    items = list(items)
    if helper is None:
        helper = len(items) >= 2 and (os.cpu_count() or 1) >= 2
    pool = None
    if helper:
        try:
            pool = multiprocessing.get_context("spawn").Pool(1, initializer=_init_helper)
        except (OSError, RuntimeError):  # no process can be started here: this process does it all
            pool = None
    front, back = 0, len(items)
    running: tuple[Any, Any] | None = None  # (item, AsyncResult) of the helper's current item
    done = False
    try:
        while front < back or running is not None:
            if pool is not None and running is None and front < back:
                back -= 1
                running = (items[back], pool.apply_async(fn, args_of(items[back])))
            if running is not None and (running[1].ready() or front >= back):
                item, pending = running
                running = None
                yield item, pending.get()  # re-raises the helper's exception here
                continue
            if front < back:
                item = items[front]
                front += 1
                yield item, fn(*args_of(item))
        done = True
    finally:
        if pool is not None:
            # finished: the helper exits on its own, running its finalizers (a killed one leaves the semaphores its
            # libraries made, such as tqdm's lock, for the resource tracker to warn about); else it is killed
            if done:
                pool.close()
            else:
                pool.terminate()
            pool.join()
