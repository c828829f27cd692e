"""Atomic file writes: a temporary file in the target folder, then a rename.

An interrupted run therefore leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import FFNQuantError

__all__ = ["ensure_writable_dir", "atomic_path", "write_bytes", "write_text", "write_json"]


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create `path` if needed and check that files can be written there."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FFNQuantError(f"cannot create output folder {str(folder)!r}: {exc.strerror or exc}") from exc
    if not folder.is_dir():
        raise FFNQuantError(f"output path {str(folder)!r} exists and is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FFNQuantError(f"output folder {str(folder)!r} is not writable")
    return folder


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it onto `target` only if the block succeeds."""
    target = Path(target)
    ensure_writable_dir(target.parent)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        # mkstemp creates the file 0600; give the result the permissions an ordinary write would
        # (0666 less the umask), so reports and artifacts stay readable by others as before.
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def _write(target: str | os.PathLike, writer: Callable[[Path], None]) -> Path:
    with atomic_path(target) as tmp:
        writer(tmp)
    return Path(target)


def write_bytes(target: str | os.PathLike, data: bytes) -> Path:
    """Write bytes atomically."""
    return _write(target, lambda p: p.write_bytes(data))


def write_text(target: str | os.PathLike, text: str) -> Path:
    """Write UTF-8 text atomically."""
    return _write(target, lambda p: p.write_text(text, encoding="utf-8"))


def write_json(target: str | os.PathLike, obj: Any) -> Path:
    """Write JSON atomically (sorted keys, so equal data gives equal files)."""
    return write_text(target, json.dumps(obj, indent=2, sort_keys=True, allow_nan=False, default=str) + "\n")
