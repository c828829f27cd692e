"""The one exception type users see: a one-line message naming what was wrong and what is valid."""

from __future__ import annotations

from typing import Iterable

__all__ = ["FFNQuantError", "Interrupted", "unknown_choice", "first_line"]


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


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type name when it has none): for availability reasons."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
