"""Progress lines with a remaining-time estimate, for a stream that cannot redraw a bar (a log file, CI, a notebook).

Every long step of the library reports `progress(message, done, total)`, message 'stage: detail'. `StageLines`
turns those reports into one line per stage when it starts, at each quarter and when it ends, with the elapsed
time and an estimate of what is left; a stage that runs again (each verification round) is timed from its own
start. The command line draws bars on a terminal and uses these lines elsewhere; the Python API writes them to
stderr unless asked to be silent (`progress=False`) or given its own callback.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, TextIO

from ..errors import FFNQuantError

__all__ = ["Progress", "StageLines", "progress_callback"]

Progress = Callable[[str, int, int], None]


class StageLines:
    """`progress(message, done, total)` as lines on `stream` (default stderr): a stage's start, each quarter, its
    end, with '{elapsed} s' and 'about {left} s left' estimated from the stage's own pace."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.clock = stream, clock
        self._stages: dict[str, tuple[float, int, int]] = {}  # stage -> (start, quarters printed, last step)

    def __call__(self, message: str, done: int, total: int) -> None:
        stage, _, detail = message.partition(": ")
        now = self.clock()
        start, printed, last = self._stages.get(stage, (now, -1, 0))
        if done < last:  # the stage runs again: its own start and quarters
            start, printed = now, -1
        quarter = 4 * done // total if total else 4
        if quarter <= printed:
            self._stages[stage] = (start, printed, done)
            return
        self._stages[stage] = (start, quarter, done)
        elapsed = now - start
        left = f", about {elapsed / done * (total - done):.0f} s left" if 0 < done < total else ""
        what = f" ({detail})" if detail else ""
        print(f"{stage}: {done}/{total}{what}, {elapsed:.0f} s{left}", file=self.stream or sys.stderr, flush=True)


def progress_callback(progress: Any, argument: str = "progress") -> Progress:
    """What a library call reports its progress to: lines on stderr (`True`, the default: a long call never looks
    hung), nothing (`False` or None), or the caller's own `callable(message, done, total)`."""
    if progress is True:
        return StageLines()
    if progress is False or progress is None:
        return lambda message, done, total: None
    if callable(progress):
        return progress
    raise FFNQuantError(f"{argument} must be True (lines on stderr), False (silent) or a callable(message, done, "
                        f"total), got {type(progress).__name__}")
