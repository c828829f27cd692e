"""One check per kind of argument, shared by the command line's argparse types and the Python API, so that
`ffnquant.plan(..., rounds=0)` is refused with the same words as `ffnquant plan --rounds 0`, before any model is
read. Each check returns the value in its canonical form or raises a one-line FFNQuantError that names the
argument and what is valid."""

from __future__ import annotations

import os
from typing import Any

from ..errors import FFNQuantError
from .resources import parse_size

__all__ = ["count", "size", "flag", "one_of_type", "text_source", "out_path", "recipe_list"]


def count(value: Any, name: str, *, minimum: int = 1, optional: bool = False) -> int | None:
    """An integer of at least `minimum` (a positive count by default); None passes when `optional`."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        what = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
        raise FFNQuantError(f"{name} must be {what}, got {value!r}")
    return int(value)


def size(value: Any, name: str) -> int | None:
    """Bytes: a size as the command line takes it ('8GB', '512MiB', '3e9') or a positive byte count; None passes."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise FFNQuantError(f"{name} must be a size such as '8GB' or '512MiB', or a byte count, got {value!r}")
    try:
        return parse_size(value)
    except FFNQuantError as exc:
        raise FFNQuantError(f"{name}: {exc}") from None


def flag(value: Any, name: str, *, optional: bool = False) -> bool | None:
    """True or False (None too when `optional`)."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise FFNQuantError(f"{name} must be True or False{' or None' if optional else ''}, got {value!r}")
    return value


def one_of_type(value: Any, name: str, types: tuple[type, ...], what: str, *, optional: bool = False) -> Any:
    """`value` itself when it is one of `types` (None too when `optional`); `what` says what is valid."""
    if (value is None and optional) or (isinstance(value, types) and not isinstance(value, bool)):
        return value
    raise FFNQuantError(f"{name} must be {what}, got {type(value).__name__} {_short(value)}")


def text_source(value: Any, name: str, sources: tuple[type, ...] = ()) -> Any:
    """A text as the API takes it: None (the shipped corpus), a file path or shipped corpus name, a list of them, or
    an instance of `sources` (the engine's `TextSource`); bytes and other objects are refused (a path is text, not
    the text's bytes)."""
    what = "a file path or shipped corpus name (e.g. 'prose'), a list of them, or a TextSource"
    if value is None or (sources and isinstance(value, sources)):
        return value
    items = [value] if isinstance(value, (str, os.PathLike)) else value
    if not isinstance(items, (list, tuple)) or not items:
        raise FFNQuantError(f"{name} must be {what}, got {type(value).__name__} {_short(value)}")
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or not str(os.fspath(item)).strip():
            raise FFNQuantError(f"{name} must be {what}; it holds {type(item).__name__} {_short(item)}")
    return value


def out_path(value: Any, name: str) -> Any:
    """A folder to write: a non-empty str or path."""
    if not isinstance(value, (str, os.PathLike)) or not str(os.fspath(value)).strip():
        raise FFNQuantError(f"{name} must be a folder path (a non-empty str or pathlib.Path), got {_short(value)}")
    return value


def recipe_list(value: Any, name: str) -> Any:
    """Candidates: a set name or comma-separated recipes (str), or a list of recipe texts / Recipe objects."""
    from ..recipe import Recipe

    what = "a candidate set name, comma-separated recipes, or a list of recipe texts or Recipes"
    if isinstance(value, (str, Recipe)):
        return value
    if not isinstance(value, (list, tuple)) or not value:
        raise FFNQuantError(f"{name} must be {what}, got {type(value).__name__} {_short(value)}")
    for item in value:
        if not isinstance(item, (str, Recipe)):
            raise FFNQuantError(f"{name} must be {what}; it holds {type(item).__name__} {_short(item)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
