"""The one exception type users see: a one-line message naming what was wrong and what is valid."""

from __future__ import annotations

import functools
import os
import re
from typing import Any, Callable, Iterable

__all__ = ["FFNQuantError", "Interrupted", "unknown_choice", "first_line", "debug_enabled", "internal_error_line",
           "api_boundary"]


class FFNQuantError(ValueError):
    """Bad input or an unusable environment; the CLI prints it on one line and exits with code 2."""

    def __init__(self, *args: object) -> None:
        # The one-line promise holds even when a message embeds a library's multi-line text.
        if args and isinstance(args[0], str) and ("\n" in args[0] or "\r" in args[0]):
            args = (" ".join(ln.strip() for ln in args[0].splitlines() if ln.strip()),) + args[1:]
        super().__init__(*args)


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, handled like Ctrl-C (staging removed, outputs as they were); `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def unknown_choice(kind: str, value: object, valid: Iterable[object]) -> FFNQuantError:
    """Build the error for a name outside a closed set, listing the valid names."""
    names = ", ".join(str(getattr(v, "value", v)) for v in valid)
    return FFNQuantError(f"unknown {kind} {value!r}; valid: {names}")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colour codes some libraries put in their messages


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, without terminal colour codes (its type name when it has none):
    for availability reasons."""
    text = _ANSI.sub("", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --- unexpected exceptions: a bug to report, never a user's error in internal words ------------------------------
def debug_enabled() -> bool:
    """FFNQUANT_DEBUG set to anything but '' or '0': unexpected exceptions keep their traceback."""
    return os.environ.get("FFNQUANT_DEBUG", "").strip() not in ("", "0")


def _step(exc: BaseException) -> str:
    """Where an exception came from: the innermost frame of an ffnquant module (module.function), and the innermost
    frame of all where that is another library's ('ffnquant.hf.capture.read_text via tokenizers....')."""
    tb, ours, last = exc.__traceback__, None, None
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        last = f"{module}.{tb.tb_frame.f_code.co_name}"
        if module == "ffnquant" or module.startswith("ffnquant."):
            ours = last
        tb = tb.tb_next
    if ours is None:
        return last or "ffnquant"
    return ours if last == ours else f"{ours} via {last}"


def internal_error_line(exc: BaseException, what: str, source: Any = None) -> str:
    """The one line an unexpected exception becomes: what was running (`what`, e.g. 'ffnquant plan'), the step inside
    ffnquant, the input, the exception's type (not its text: that is internal) and how to report it."""
    on = f" on {source}" if source not in (None, "") else ""
    return (f"{what} failed{on}: an internal error ({type(exc).__name__} in {_step(exc)}), a bug in ffnquant; please "
            "report it with the command or call, and the traceback that --debug or FFNQUANT_DEBUG=1 prints")


def api_boundary(fn: Callable) -> Callable:
    """A public API verb whose unexpected exceptions become one FFNQuantError line (`internal_error_line`), the
    input named; with FFNQUANT_DEBUG=1 they pass as they are. FFNQuantError and interruptions pass untouched."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FFNQuantError:
            raise
        except Exception as exc:
            if debug_enabled():
                raise
            first = args[0] if args else next(iter(kwargs.values()), None)
            source = repr(str(first)) if isinstance(first, (str, os.PathLike)) else type(first).__name__
            raise FFNQuantError(internal_error_line(exc, f"ffnquant.{fn.__name__}", source)) from None

    return wrapper
