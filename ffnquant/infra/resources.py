"""What an input asks of the machine, checked before it is taken: memory for tensors, readable regular files.

Both turn what would be a crash, a hang or a traceback deep inside torch, numpy or
safetensors into a one-line `FFNQuantError` naming the input and what is valid.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ..errors import FFNQuantError

__all__ = [
    "MAX_ELEMENTS",
    "available_memory",
    "human_bytes",
    "check_memory",
    "parse_size",
    "process_rss",
    "memory_limit",
    "regular_file",
    "read_text",
    "read_bytes",
    "os_reason",
    "non_regular_entries",
]

# Element counts beyond this overflow torch's and numpy's int64 size arithmetic once multiplied
# by an element size (8 bytes at most here), so FFNSpec refuses them before any memory math.
MAX_ELEMENTS = 2**62
# Allocations this small are not checked: reading /proc/meminfo for each would cost more than
# they do, and a machine short of 64 MiB fails elsewhere anyway.
_UNCHECKED_BYTES = 64 * 2**20


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation without swapping, or None when unknown.

    Linux: MemAvailable of /proc/meminfo (the kernel's estimate, page cache counted as
    reclaimable). Elsewhere: psutil's `virtual_memory().available` if psutil is importable.
    Otherwise None, and the memory checks are skipped: no estimate beats a wrong refusal.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil  # optional: only where /proc/meminfo is absent (macOS, Windows)
    except Exception:
        return None
    try:
        return int(psutil.virtual_memory().available)
    except Exception:
        return None


def human_bytes(n: float) -> str:
    """'21.3 GB', '16.0 TB': decimal units, as memory is usually quoted."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB", "EB"):
        if abs(n) < 1000 or unit == "EB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def check_memory(n_bytes: int, what: str, hint: str, purpose: str = "") -> None:
    """Refuse, before allocating, `n_bytes` that the machine does not have.

    The message reads "<what> needs <size> <purpose>; this machine has <size> available: <hint>",
    e.g. what="relu at d_model 4096 (d_ff 16384)", purpose="for its weights", hint="choose a smaller d_model".
    """
    if n_bytes <= _UNCHECKED_BYTES:
        return
    have = available_memory()
    if have is not None and n_bytes > have:
        purpose = f" {purpose}" if purpose else ""
        raise FFNQuantError(
            f"{what} needs {human_bytes(n_bytes)}{purpose}; this machine has {human_bytes(have)} available: {hint}"
        )


_SIZE = re.compile(r"(?P<n>(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*(?:(?P<prefix>[kmgtp])(?P<binary>i)?)?b?",
                   re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes of a size as a user writes it: '8GB', '8g', '512MB', '1.5GiB', '3e9', '4096'.

    k/M/G/T/P are decimal, as `human_bytes` prints them; KiB/MiB/GiB/TiB/PiB are powers of 1024."""
    m = _SIZE.fullmatch(str(text).strip())
    if m is None:
        raise FFNQuantError(f"{text!r} is not a memory size: write e.g. 8GB, 512MB, 1.5GiB or a byte count")
    power = "kmgtp".index(m.group("prefix").lower()) + 1 if m.group("prefix") else 0
    value = float(m.group("n")) * (1024 if m.group("binary") else 1000) ** power
    if not 1 <= value <= 2**62:
        raise FFNQuantError(f"memory size {text!r} must be at least 1 byte and at most 4 EiB")
    return int(value)


def process_rss() -> int:
    """Bytes this process holds in memory now (VmRSS of /proc/self/status; psutil elsewhere; 0 when unknown)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except Exception:
        return 0


def memory_limit(max_memory: int | None) -> int | None:
    """The memory this process may hold in all: `max_memory` when given, else what it holds now plus what the
    machine has available (None when that is unknown: then nothing is refused on memory grounds)."""
    if max_memory is not None:
        return max_memory
    have = available_memory()
    return None if have is None else process_rss() + have


# --- input files -------------------------------------------------------------------------------

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def os_reason(exc: OSError) -> str:
    """The short reason of an OSError ('permission denied'), without errno numbers or paths."""
    if isinstance(exc, PermissionError):
        return "permission denied"
    return (exc.strerror or type(exc).__name__).lower()


def regular_file(path: str | os.PathLike, what: str, readable: bool = True) -> Path:
    """`path` if it is a regular file (links followed) that can be opened; else a one-line error.

    A FIFO or a device would block or stream forever when read, so it is refused before opening;
    `readable` then opens and closes the file, so a permission problem is named here rather than
    surfacing from deep inside numpy, safetensors or torch.
    """
    p = Path(path)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise FFNQuantError(f"{what} {str(p)!r} does not exist") from None
    except OSError as exc:  # a folder on the way without search permission, a link loop, ...
        raise FFNQuantError(f"{what} {str(p)!r} cannot be accessed: {os_reason(exc)}") from None
    if not stat.S_ISREG(mode):
        raise FFNQuantError(f"{what} {str(p)!r} is {_kind(mode)}, not a regular file")
    if readable:
        try:
            open(p, "rb").close()
        except OSError as exc:
            raise FFNQuantError(f"cannot read {what} {str(p)!r}: {os_reason(exc)}") from None
    return p


def read_bytes(path: str | os.PathLike, what: str) -> bytes:
    """The bytes of a regular file, with one-line errors (see `regular_file`)."""
    p = regular_file(path, what, readable=False)
    try:
        with open(p, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise FFNQuantError(f"cannot read {what} {str(p)!r}: {os_reason(exc)}") from None


def read_text(path: str | os.PathLike, what: str) -> str:
    """The UTF-8 text of a regular file, with one-line errors (see `regular_file`)."""
    data = read_bytes(path, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FFNQuantError(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start})") from None


def non_regular_entries(folder: str | os.PathLike, what: str) -> list[tuple[str, str]]:
    """(name, kind) of the entries of `folder` that are neither regular files nor folders (FIFOs, devices).

    Broken links are left out (a reader reports them as missing); an unlistable folder is an error.
    """
    out = []
    try:
        names = sorted(os.listdir(folder))
    except OSError as exc:
        raise FFNQuantError(f"cannot list {what} {str(folder)!r}: {os_reason(exc)}") from None
    for name in names:
        try:
            mode = os.stat(os.path.join(folder, name)).st_mode
        except OSError:
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            out.append((name, _kind(mode)))
    return out
