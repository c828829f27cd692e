"""A whole output folder written beside its target and renamed into place (`staged_folder`), and the checks
before it: never one of the run's inputs, and `--force` replaces only what an earlier ffnquant run listed.
Split from `atomic` (which re-exports these names) to keep each module one concern."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Iterator, Sequence

from .atomic import _sigint_deferred, make_staging, sweep_stale
from ..errors import FFNQuantError, Interrupted

__all__ = ["check_not_an_input", "folder_files", "check_new_folder", "staged_folder", "termination_unwinds"]


def check_not_an_input(target: str | os.PathLike, inputs: Sequence[str | os.PathLike | None]) -> None:
    """Refuse an output folder that is, or holds, one of the run's own inputs (a model folder, a plan file, a
    text): replacing it would destroy what the run reads, `--force` or not."""
    out = Path(target).resolve()
    for item in inputs:
        if item is None or str(item) == "":
            continue
        p = Path(item).resolve()
        if p == out or out in p.parents:
            raise FFNQuantError(f"output folder {str(target)!r} holds this run's input {str(item)!r}: writing there "
                                "would replace it; give another --out")


def folder_files(folder: str | os.PathLike) -> list[str]:
    """Every file under `folder` as a sorted relative POSIX path (what a listing records)."""
    root = Path(folder)
    return sorted(Path(d, n).relative_to(root).as_posix() for d, _, names in os.walk(root) for n in names)


def _check_listed(target: Path, listing: str) -> None:
    """With --force, refuse a folder that holds anything its `listing` (an earlier ffnquant run's JSON document,
    key "files") does not name: --force replaces what ffnquant wrote there, never another command's files."""
    have = folder_files(target)
    try:
        doc = json.loads((target / listing).read_text(encoding="utf-8"))
        listed = {str(f) for f in doc["files"]}
    except (OSError, ValueError, KeyError, TypeError):
        listed = set()
    others = [f for f in have if f not in listed and f != listing]
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        why = (f"not listed in its {listing}" if listed else f"its {listing} lists no files" if listing in have
               else f"it holds no {listing} of an earlier ffnquant command")
        raise FFNQuantError(f"--force replaces only what an earlier ffnquant command listed in its {listing}, but "
                            f"{str(target)!r} also holds {shown} ({why}); move them or give another --out")


def check_new_folder(target: str | os.PathLike, force: bool = False,
                     inputs: Sequence[str | os.PathLike | None] = (), listing: str | None = None,
                     make_parents: bool = False) -> Path:
    """Refuse, before any work, an output folder that cannot be (re)placed: an empty path, a path that is not a
    folder, a folder that exists and is not empty (unless `force`; given a `listing`, only when every file in it
    is named by that earlier run's document), one that is or holds one of the run's `inputs`, a parent that
    cannot be written (with `make_parents`, a missing parent is made later: its nearest existing folder must be
    writable). Returns the target."""
    if str(target).strip() == "":
        raise FFNQuantError("the output folder is empty (--out ''); name a folder")
    check_not_an_input(target, inputs)
    target = Path(target)
    if os.path.lexists(target):
        if target.is_symlink() or not target.is_dir():
            raise FFNQuantError(f"output path {str(target)!r} exists and is not a folder")
        try:
            empty = not any(os.scandir(target))
        except OSError as exc:
            raise FFNQuantError(f"output folder {str(target)!r} cannot be read: {exc.strerror or exc}") from None
        if not empty and not force:
            raise FFNQuantError(f"output folder {str(target)!r} exists and is not empty; give another --out or --force "
                                "to replace it")
        if not empty and listing is not None:
            _check_listed(target, listing)
    parent = target.resolve().parent
    if make_parents:
        while not os.path.lexists(parent) and parent != parent.parent:
            parent = parent.parent
    if not parent.is_dir():
        raise FFNQuantError(f"the folder {str(parent)!r} for output {str(target)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FFNQuantError(f"cannot write output folder {str(target)!r}: {str(parent)!r} is not writable")
    return target


@contextlib.contextmanager
def staged_folder(target: str | os.PathLike, force: bool = False, listing: str | None = None,
                  make_parents: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder beside `target`; when the block succeeds it becomes `target` by a rename
    (an existing `target` is replaced only with `force`, or when empty). On an exception or Ctrl-C the staging
    folder is removed and `target` is exactly as it was (parents `make_parents` made are removed too). OSErrors
    of writing become one-line FFNQuantErrors."""
    target = check_new_folder(target, force, listing=listing, make_parents=make_parents)
    parent = target.resolve().parent
    made: list[Path] = []
    p = parent
    while make_parents and not os.path.lexists(p):
        made.insert(0, p)
        p = p.parent
    try:
        for d in made:
            d.mkdir()
        sweep_stale(parent)
        staging = make_staging(parent)
    except OSError as exc:
        _remove_empty(made)
        raise FFNQuantError(f"cannot write in {str(parent)!r}: {exc.strerror or exc}") from None
    content = staging / "content"  # the folder that becomes `target`; the marker stays outside it
    old: Path | None = None
    try:
        content.mkdir()
        yield content
        mask = os.umask(0)
        os.umask(mask)
        # libraries that write into the folder pick their own modes (transformers' save_pretrained writes the
        # weights 0600, unreadable to a server running as another user): every entry gets the umask's mode
        for root, dirs, files in os.walk(content):
            for d in dirs:
                os.chmod(os.path.join(root, d), 0o777 & ~mask)
            for f in files:
                p = os.path.join(root, f)
                if not os.path.islink(p):
                    os.chmod(p, 0o666 & ~mask)
        os.chmod(content, 0o777 & ~mask)  # an ordinary folder's mode
        with _sigint_deferred() as moves:
            if os.path.lexists(target):
                os.replace(target, staging / "replaced")  # kept until the new folder is in place
                old = staging / "replaced"
            os.replace(content, target)
            moves.done = True
    except OSError as exc:
        if old is not None and not os.path.lexists(target) and os.path.lexists(old):
            os.replace(old, target)  # put the user's folder back
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(made)
        raise FFNQuantError(f"cannot write output folder {str(target)!r}: {exc.strerror or exc}") from None
    except BaseException:
        if old is not None and not os.path.lexists(target) and os.path.lexists(old):
            os.replace(old, target)
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(made)
        raise
    shutil.rmtree(staging, ignore_errors=True)  # the marker and the replaced folder


def _remove_empty(made: list[Path]) -> None:
    """The parents a failed write made, deepest first, where still empty."""
    for d in reversed(made):
        with contextlib.suppress(OSError):
            d.rmdir()


@contextlib.contextmanager
def termination_unwinds() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise `Interrupted` (as Ctrl-C raises KeyboardInterrupt), so the
    library's staging and scratch folders are removed on the way out; the OS default would end the process at once
    and leave them. The command line does this for the whole process; the Python API (`ffnquant.save`, `apply`,
    `plan`) for the time it writes. Only in the main thread (the only one Python lets install a handler), only over
    the OS default (a caller's own handler or an ignored SIGHUP stays), and the previous handler comes back after."""
    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        def raise_interrupted(signum: int, frame: object) -> None:
            raise Interrupted(signum)

        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
                previous[sig] = signal.signal(sig, raise_interrupted)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
