"""The one exception type users see: a one-line message naming what was wrong and what is valid."""

from __future__ import annotations

from typing import Iterable

__all__ = ["FFNQuantError", "unknown_choice"]


class FFNQuantError(ValueError):
    """Bad input or an unusable environment; the CLI prints it on one line and exits with code 2."""


def unknown_choice(kind: str, value: object, valid: Iterable[object]) -> FFNQuantError:
    """Build the error for a name outside a closed set, listing the valid names."""
    names = ", ".join(str(getattr(v, "value", v)) for v in valid)
    return FFNQuantError(f"unknown {kind} {value!r}; valid: {names}")
