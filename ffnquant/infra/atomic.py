"""Safe output: atomic single-file writes and whole-run output transactions.

`atomic_path` writes one file as a temporary file beside it, then renames it into place, so a
reader sees the old file or the new one, never half of one.

`OutputTransaction` does the same for a command's whole output set: every file is written into a
staging folder inside each target folder (`<target>/.ffnquant-staging-<host>-<pid>-<random>/`)
and moved into place only after everything was written. Before the first move every target is
checked (not a folder, not read-only or immutable); a move that still fails puts back the files
already moved. So a failure, a full disk or Ctrl-C leaves the target folders exactly as they were,
and a run never deletes or overwrites a file other than the outputs it replaces.

Temporary names carry this host and process id, so each run sweeps the leftovers of killed runs
(SIGKILL, power loss) from the folders it writes to without touching those of a run still going.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

from ..errors import FFNQuantError

__all__ = [
    "ensure_writable_dir", "atomic_path", "write_bytes", "write_text", "write_json",
    "OutputTransaction", "sweep_stale", "is_output_failure", "STALE_AGE_S", "make_staging", "owned_temp_file",
    "ScratchFolder", "process_scratch",
]

# Leftovers without a live owner we can check are removed once they are this old.
STALE_AGE_S = 3600.0
# Those of another host (a shared folder) only after a day: its run may still be going.
FOREIGN_STALE_AGE_S = 86400.0
STAGING_PREFIX = ".ffnquant-staging-"
_HOST = hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]
_RAND = r"[a-z0-9_]{8}"  # tempfile's random part
_OWNED = rf"(?P<host>[0-9a-f]{{8}})-(?P<pid>\d+)-{_RAND}"
# Our own temporary names, and nothing else: a user's file never matches these.
_STAGING_RE = re.compile(rf"^{re.escape(STAGING_PREFIX)}{_OWNED}$")
_TMP_RE = re.compile(rf"^\.(?P<target>.+)\.ffnq-{_OWNED}\.tmp$")  # atomic_path (this version)
# A staging folder is ours only with this file inside as well as the name: a user's folder of a like name is kept.
# (Names without an owner part, such as `.x.abcdefgh.tmp` or `x.onnx.partial`, are never swept: a user's file can
# carry them, so they are not matched by pattern and age.)
STAGING_MARKER = ".ffnquant-staging"
# OSErrors that only writing raises (a full disk, a quota, a read-only mount): reported in one line.
# Others (permission denied, ...) are reported so only when they name a staged file, since reading
# an input can raise them too.
_WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def is_output_failure(exc: BaseException) -> bool:
    """Whether `exc` says the outputs cannot be written (a full disk, a staged file refused): code that
    records a failed case and goes on must let these through, so the whole run stops and leaves nothing."""
    if not isinstance(exc, OSError):
        return False
    return exc.errno in _WRITE_ERRNOS or (exc.filename is not None and STAGING_PREFIX in str(exc.filename))


def ensure_writable_dir(path: str | os.PathLike) -> Path:
    """Create `path` if needed and check that files can be written there."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise FFNQuantError(f"output path {str(folder)!r} exists and is not a folder") from None
    except OSError as exc:
        raise FFNQuantError(f"cannot create output folder {str(folder)!r}: {exc.strerror or exc}") from exc
    if not folder.is_dir():
        raise FFNQuantError(f"output path {str(folder)!r} exists and is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise FFNQuantError(f"output folder {str(folder)!r} is not writable")
    return folder


def _owner_tag() -> str:
    return f"{_HOST}-{os.getpid()}-"


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it onto `target` only if the block succeeds."""
    target = Path(target)
    ensure_writable_dir(target.parent)
    tmp: Path | None = None
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.ffnq-{_owner_tag()}", suffix=".tmp", dir=target.parent)
        tmp = Path(tmp_name)
        os.close(fd)
        yield tmp
        # mkstemp creates the file 0600; give the result the permissions an ordinary write would
        # (0666 less the umask), so reports and artifacts stay readable by others as before.
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, target)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()


def owned_temp_file(folder: str | os.PathLike, name: str) -> Path:
    """A new empty scratch file in `folder` named as ours (`.NAME.ffnq-<host>-<pid>-<random>.tmp`): the sweep
    removes it once its run is over, and nothing else of that folder."""
    fd, path = tempfile.mkstemp(prefix=f".{name}.ffnq-{_owner_tag()}", suffix=".tmp", dir=folder)
    os.close(fd)
    return Path(path)


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


# --- stale leftovers ---------------------------------------------------------------------------

def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # someone else's process (or a number we cannot check): assume it runs
    return True


def _is_stale(name: str, mtime: float, now: float) -> bool:
    """Whether `name` is one of our temporary names (owner host and pid in it) whose run is over."""
    m = _STAGING_RE.match(name) or _TMP_RE.match(name)
    if m is None:
        return False
    if m["host"] == _HOST:
        return not _pid_alive(int(m["pid"]))
    return now - mtime > FOREIGN_STALE_AGE_S


def make_staging(parent: str | os.PathLike) -> Path:
    """A new staging folder in `parent`, named with this run's owner tag and marked inside, so that a sweep can
    tell it from anything else."""
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX + _owner_tag(), dir=parent))
    try:
        (staging / STAGING_MARKER).write_bytes(b"")
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return staging


_SWEPT: set[Path] = set()


_PROCESS_SCRATCH: dict[str, "ScratchFolder"] = {}


def process_scratch(purpose: str) -> Path:
    """A marked scratch folder that lives as long as this process (removed at exit; a killed run's is swept by the
    next run): for files a runtime keeps across calls, such as built ONNX artifacts or an engine cache."""
    if purpose not in _PROCESS_SCRATCH:
        _PROCESS_SCRATCH[purpose] = ScratchFolder(purpose)
    return Path(_PROCESS_SCRATCH[purpose].name)


class ScratchFolder:
    """A temporary folder, like `tempfile.TemporaryDirectory`, but named and marked as ours: removed on `cleanup()`
    (or leaving the with block, or at exit), and should the run be killed first, by the sweep of the next run that
    makes one in the same parent. `with ScratchFolder("bench") as folder:` gives the folder as a Path."""

    def __init__(self, purpose: str, dir: str | os.PathLike | None = None) -> None:
        parent = Path(dir) if dir is not None else Path(tempfile.gettempdir())
        if parent not in _SWEPT:  # earlier runs' leftovers, ours only: once per folder and process is enough
            sweep_stale(parent)
            _SWEPT.add(parent)
        root = make_staging(parent)
        # the folder handed out is inside the marked one, so its users never see the marker file
        self.name = str(root / purpose)
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(root), ignore_errors=True)
        try:
            os.mkdir(self.name)
        except OSError:
            self.cleanup()
            raise

    def cleanup(self) -> None:
        self._finalizer()

    def __enter__(self) -> Path:
        return Path(self.name)

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


def sweep_stale(folder: str | os.PathLike) -> list[Path]:
    """Remove the leftovers of killed runs from `folder` (ours only; best effort); returns what was removed."""
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode) or not _is_stale(entry.name, st.st_mtime, now):
                continue  # we never make links: a link of that name is not ours
            if stat.S_ISDIR(st.st_mode):
                if not _STAGING_RE.match(entry.name) or not os.path.isfile(os.path.join(entry.path, STAGING_MARKER)):
                    continue  # a folder of our name but without our marker: not ours
                shutil.rmtree(entry.path)
            elif _TMP_RE.match(entry.name):
                os.unlink(entry.path)
            else:
                continue
            removed.append(Path(entry.path))
        except OSError:
            continue
    return removed


# --- transactions ------------------------------------------------------------------------------

_DEFERRED = tuple(s for s in (getattr(signal, "SIGINT", None), getattr(signal, "SIGTERM", None),
                               getattr(signal, "SIGHUP", None)) if s is not None)


class _Moves:
    """What a deferred block reports back: `done` once the new outputs are all in place."""

    done = False


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[_Moves]:
    """Hold Ctrl-C (and SIGTERM/SIGHUP where ffnquant handles them) while files are moved or removed, then raise
    it: a move set is never cut in half. A block that sets `.done` on what it is given says its new outputs are in
    place: the interruption then carries `outputs_complete = True`, so the CLI does not claim nothing was written."""
    moves = _Moves()
    if threading.current_thread() is not threading.main_thread():
        yield moves  # not ours to handle here
        return
    caught: list[int] = []
    previous: dict[int, Any] = {}
    for sig in _DEFERRED:
        if callable(signal.getsignal(sig)):  # ignored (a background job) or the OS default: left so
            with contextlib.suppress(ValueError, OSError):
                previous[sig] = signal.signal(sig, lambda signum, frame: caught.append(signum))
    try:
        yield moves
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if caught:
            from ..errors import Interrupted

            exc = KeyboardInterrupt() if caught[0] == signal.SIGINT else Interrupted(caught[0])
            exc.outputs_complete = moves.done  # type: ignore[attr-defined]
            raise exc


def _immutable(path: Path) -> bool:
    """Linux's immutable / append-only flags (chattr +i / +a), which even root cannot replace."""
    try:
        import fcntl
        import struct

        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except (ImportError, OSError):
        return False
    try:
        buf = fcntl.ioctl(fd, 0x80086601, struct.pack("l", 0))  # FS_IOC_GETFLAGS
        flags = struct.unpack("l", buf)[0]
        return bool(flags & (0x10 | 0x20))  # FS_IMMUTABLE_FL | FS_APPEND_FL
    except OSError:
        return False
    finally:
        os.close(fd)


class OutputTransaction:
    """A command's whole output set, staged and then moved into place (all or nothing).

        with OutputTransaction() as tx:
            out = tx.folder("reports")       # the staging folder standing for reports/
            write_json(out / "report.json", doc)
            shown = tx.final(out / "report.json")   # reports/report.json, for messages and reports
        # reports/report.json is in place here; after an exception reports/ is exactly as before

    On an exception (or KeyboardInterrupt) everything staged is removed, and so are output
    folders this transaction created; an OSError such as a full disk becomes a one-line
    FFNQuantError naming the file.
    """

    def __init__(self, *folders: str | os.PathLike) -> None:
        self._initial = folders
        self._stages: dict[Path, tuple[Path, Path]] = {}  # resolved target -> (target as given, staging)
        self._created: list[Path] = []  # folders this transaction created, parents first
        self._open = False
        self._interrupted = False
        self._sigint_previous: Any = None
        self.committed: list[Path] = []

    def __enter__(self) -> "OutputTransaction":
        self._open = True
        self._watch_sigint()
        try:
            for f in self._initial:
                self.folder(f)
        except BaseException:
            self.rollback()
            self._unwatch_sigint()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        try:
            if exc is None and not self._interrupted:
                self.commit()
                return False
            error = self._as_error(exc) if isinstance(exc, OSError) else None  # before the staging names are gone
            self.rollback()
            if self._interrupted and not isinstance(exc, KeyboardInterrupt):
                # Ctrl-C that a library turned into another error (an import cut short) or swallowed:
                # still an interruption, reported as one
                raise KeyboardInterrupt from None
            if error is not None:
                raise error from None
            return False
        finally:
            self._unwatch_sigint()

    def _watch_sigint(self) -> None:
        """Note any Ctrl-C during the block (then raise KeyboardInterrupt as before)."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGINT)
        if not callable(previous):
            return  # ignored (a background job) or the OS default: leave it so

        def on_sigint(signum: int, frame: Any) -> None:
            self._interrupted = True
            previous(signum, frame)

        try:
            signal.signal(signal.SIGINT, on_sigint)
        except (ValueError, OSError):
            return
        self._sigint_previous = previous

    def _unwatch_sigint(self) -> None:
        if self._sigint_previous is not None:
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGINT, self._sigint_previous)
            self._sigint_previous = None

    # -- staging --

    def folder(self, target: str | os.PathLike) -> Path:
        """The staging folder for output folder `target` (created, checked and swept on first use)."""
        if not self._open:
            raise RuntimeError("OutputTransaction.folder() outside its with block")
        if str(target).strip() == "":  # Path('') is the working folder: never written into by accident
            raise FFNQuantError("the output folder is empty (--out ''); name a folder")
        key = Path(target).resolve()
        if key in self._stages:
            return self._stages[key][1]
        missing = []
        p = key
        while not os.path.lexists(p) and p != p.parent:
            missing.append(p)
            p = p.parent
        # noted first: should the check below fail after creating them, the rollback removes them (if empty)
        self._created += [m for m in reversed(missing) if m not in self._created]
        folder = ensure_writable_dir(target)
        sweep_stale(folder)
        try:
            staging = make_staging(folder)
        except OSError as exc:
            raise FFNQuantError(f"cannot write in output folder {str(folder)!r}: {exc.strerror or exc}") from None
        self._stages[key] = (Path(target), staging)
        return staging

    def path(self, target_file: str | os.PathLike) -> Path:
        """Where to write the output that will become `target_file`."""
        target_file = Path(target_file)
        return self.folder(target_file.parent) / target_file.name

    def final(self, path: str | os.PathLike) -> Path:
        """The path a staged file will have once committed (other paths unchanged)."""
        p = Path(path)
        for shown, staging in self._stages.values():
            for candidate, root in ((p, staging), (p.resolve(), staging.resolve())):
                try:
                    return shown / candidate.relative_to(root)
                except ValueError:
                    continue
        return p

    # -- commit and rollback --

    def _staged_files(self) -> list[tuple[Path, Path, Path]]:
        """(staged file, final path, target folder) for every file written, in a stable order."""
        out = []
        for key, (shown, staging) in self._stages.items():
            for dirpath, dirnames, filenames in os.walk(staging):
                dirnames.sort()
                for name in sorted(filenames):
                    if _TMP_RE.match(name) or (name == STAGING_MARKER and dirpath == str(staging)):
                        continue  # a writer's own temporary file, or the staging folder's marker, is never an output
                    src = Path(dirpath) / name
                    out.append((src, key / src.relative_to(staging), shown / src.relative_to(staging)))
        return out

    def _check_target(self, final: Path, shown: Path) -> None:
        """Refuse, before anything moves, a target that cannot be replaced."""
        parent = final.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise FFNQuantError(f"cannot write {str(shown)!r}: {str(parent)!r} is a file, not a folder")
        if os.path.lexists(final):
            mode = final.lstat().st_mode
            if stat.S_ISDIR(mode):
                raise FFNQuantError(f"cannot write {str(shown)!r}: a folder of that name is in the way "
                                    "(move it, or choose another output folder)")
            if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                raise FFNQuantError(f"cannot write {str(shown)!r}: something that is not a regular file is in the way "
                                    "(move it, or choose another output folder)")
            if stat.S_ISREG(mode) and (not os.access(final, os.W_OK) or _immutable(final)):
                raise FFNQuantError(f"cannot replace {str(shown)!r}: the file is read-only or immutable "
                                    "(make it writable, or choose another output folder)")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise FFNQuantError(f"cannot write {str(shown)!r}: folder {str(parent)!r} is not writable")

    def commit(self) -> list[Path]:
        """Move every staged file into place; on any failure put back what moved and raise FFNQuantError."""
        if not self._open:
            return self.committed
        try:
            files = self._staged_files()
            for _, final, shown in files:
                self._check_target(final, shown)
        except BaseException:
            self.rollback()
            raise
        with _sigint_deferred() as moves:
            moved: list[tuple[Path, Path | None]] = []  # (final, hard-linked copy of the file it replaced)
            made_dirs: list[Path] = []
            try:
                for i, (src, final, shown) in enumerate(files):
                    missing = []
                    d = final.parent
                    while not d.exists():
                        missing.append(d)
                        d = d.parent
                    for d in reversed(missing):
                        d.mkdir()
                        made_dirs.append(d)
                    backup = None
                    if os.path.lexists(final):
                        # a second name for the old file, so it can be put back if a later move fails
                        backup = src.with_name(f"{src.name}.ffnq-{_owner_tag()}old{i:05d}.tmp")
                        try:
                            os.link(final, backup, follow_symlinks=False)
                        except OSError:
                            backup = None
                    os.replace(src, final)
                    moved.append((final, backup))
            except OSError as exc:
                name = exc.filename if exc.filename is not None else shown
                failed = self.final(name)
                for final, backup in reversed(moved):
                    with contextlib.suppress(OSError):
                        if backup is not None:
                            os.replace(backup, final)
                        else:
                            os.unlink(final)
                for d in reversed(made_dirs):
                    with contextlib.suppress(OSError):
                        d.rmdir()
                self.rollback()
                raise FFNQuantError(f"cannot write {str(failed)!r}: {exc.strerror or exc}; no output file was changed") from None
            self.committed = [shown for _, _, shown in files]
            moves.done = True
            self._remove_staging()
            self._open = False
        for key in {final.parent for _, final, _ in files}:
            sweep_stale(key)
        return self.committed

    def rollback(self) -> None:
        """Remove everything staged, and the output folders this transaction created if left empty."""
        with _sigint_deferred():
            self._remove_staging()
            for d in reversed(self._created):
                with contextlib.suppress(OSError):
                    d.rmdir()  # only if empty: never a file of anyone's
            self._created.clear()
            self._open = False

    def _remove_staging(self) -> None:
        # the mapping stays: `final` still names files after the commit
        for _, staging in self._stages.values():
            shutil.rmtree(staging, ignore_errors=True)

    def _as_error(self, exc: OSError) -> FFNQuantError | None:
        """A write failure inside the block as one line naming the file (None: not a write failure)."""
        name = exc.filename
        shown = self.final(name) if name is not None else None
        ours = shown is not None and Path(name) != shown
        if exc.errno not in _WRITE_ERRNOS and not ours:
            return None
        # name the file as the user will know it (its final path), not its staging path
        if ours:
            m = _TMP_RE.match(shown.name)  # atomic_path's temporary file: name the file it stands for
            what = repr(str(shown.with_name(m["target"]) if m else shown))
        elif name is not None:
            what = repr(str(name))
        else:
            what = "the outputs in " + ", ".join(repr(str(t)) for t, _ in self._stages.values())
        return FFNQuantError(f"cannot write {what}: {exc.strerror or exc}; no output file was changed")


# A whole folder written beside its target and renamed into place: ffnquant/atomic_folder.py (staged_folder).
