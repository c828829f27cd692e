"""Output transactions: all or nothing, no user file lost, interruption and full disks leave nothing behind."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ffnquant.infra.atomic as atomic
import ffnquant.infra.atomic_folder as atomic_folder
from ffnquant.infra.atomic import STAGING_PREFIX, OutputTransaction, atomic_path, sweep_stale, write_bytes, write_text
from ffnquant.cli import main
from ffnquant.errors import FFNQuantError

USER_BYTES = b"the user's own file, not ours\n"


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under `folder` (hidden ones too): file bytes, None for folders."""
    if not folder.exists():
        return {}
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


def leftovers(*folders: Path) -> list[str]:
    """Temporary names of ours (or of earlier versions) anywhere under `folders`."""
    out = []
    for folder in folders:
        if folder.exists():
            out += [str(p) for p in folder.rglob("*")
                    if p.name.startswith(STAGING_PREFIX) or p.name.endswith((".tmp", ".partial"))]
    return out


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def age(path: Path, seconds: float) -> Path:
    t = time.time() - seconds
    os.utime(path, (t, t))
    return path


@pytest.fixture
def out(tmp_path):
    """An output folder holding an unrelated user file and an earlier output `a.txt`."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "notes.bin").write_bytes(USER_BYTES)
    (folder / "a.txt").write_text("old a\n")
    return folder


# --- the transaction itself -------------------------------------------------------------------

def test_commit_moves_everything_into_place(out):
    before = snapshot(out)
    with OutputTransaction() as tx:
        stage = tx.folder(out)
        write_text(stage / "a.txt", "new a\n")
        write_bytes(stage / "plots" / "p.png", b"png")
        assert tx.final(stage / "plots" / "p.png") == out / "plots" / "p.png"
        assert snapshot(out) == {**before, stage.name: None, f"{stage.name}/a.txt": b"new a\n",
                                 f"{stage.name}/{atomic.STAGING_MARKER}": b"",
                                 f"{stage.name}/plots": None, f"{stage.name}/plots/p.png": b"png"}
    assert snapshot(out) == {"a.txt": b"new a\n", "notes.bin": USER_BYTES, "plots": None, "plots/p.png": b"png"}
    assert tx.committed == [out / "a.txt", out / "plots" / "p.png"]


@pytest.mark.parametrize("exc", [RuntimeError("bug"), KeyboardInterrupt(), FFNQuantError("bad input")],
                         ids=["error", "keyboard-interrupt", "refusal"])
def test_failure_inside_the_block_leaves_the_folder_as_before(out, tmp_path, exc):
    before = snapshot(out)
    new_folder = tmp_path / "new" / "deeper"
    with pytest.raises(type(exc)):
        with OutputTransaction() as tx:
            write_text(tx.folder(out) / "a.txt", "new a\n")
            write_text(tx.folder(new_folder) / "b.txt", "b\n")
            with atomic_path(tx.folder(out) / "c.onnx") as tmp:
                tmp.write_bytes(b"half an artif")
                raise exc
    assert snapshot(out) == before
    assert not (tmp_path / "new").exists()  # folders the run created are gone again


def test_a_folder_in_the_way_is_refused_before_anything_moves(out):
    (out / "z.onnx").mkdir()
    before = snapshot(out)
    with pytest.raises(FFNQuantError) as info:
        with OutputTransaction() as tx:
            write_text(tx.folder(out) / "a.txt", "new a\n")  # moved first in name order, were it moved
            write_text(tx.folder(out) / "z.onnx", "new z\n")
    msg = str(info.value)
    assert "z.onnx" in msg and "folder of that name is in the way" in msg and "\n" not in msg
    assert snapshot(out) == before


def test_an_immutable_target_is_refused(out, monkeypatch):
    monkeypatch.setattr(atomic, "_immutable", lambda p: p.name == "a.txt")
    before = snapshot(out)
    with pytest.raises(FFNQuantError, match=r"cannot replace .*a\.txt.*read-only or immutable"):
        with OutputTransaction() as tx:
            write_text(tx.folder(out) / "a.txt", "new a\n")
    assert snapshot(out) == before


def test_a_really_immutable_target_is_refused(out):
    """chattr +i, where this machine allows it (root on ext4/xfs/btrfs); skipped elsewhere."""
    import shutil as sh

    target = out / "a.txt"
    if sh.which("chattr") is None or subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode:
        pytest.skip("chattr +i is not possible here")
    try:
        before = snapshot(out)
        with pytest.raises(FFNQuantError, match="read-only or immutable"):
            with OutputTransaction() as tx:
                write_text(tx.folder(out) / "a.txt", "new a\n")
        assert snapshot(out) == before
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may replace read-only files")
def test_a_read_only_target_is_refused(out):
    (out / "a.txt").chmod(0o444)
    before = snapshot(out)
    with pytest.raises(FFNQuantError, match="read-only or immutable"):
        with OutputTransaction() as tx:
            write_text(tx.folder(out) / "a.txt", "new a\n")
    assert snapshot(out) == before


def test_a_move_failing_midway_puts_back_the_files_already_moved(out, monkeypatch):
    real = os.replace
    moves = []

    def replace(src, dst):
        if STAGING_PREFIX in str(src) and STAGING_PREFIX not in str(dst):  # a commit move
            moves.append(dst)
            if len(moves) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(src, dst)

    before = snapshot(out)
    monkeypatch.setattr(atomic.os, "replace", replace)
    with pytest.raises(FFNQuantError) as info:
        with OutputTransaction() as tx:
            write_text(tx.folder(out) / "a.txt", "new a\n")
            write_text(tx.folder(out) / "b.txt", "new b\n")
    assert str(info.value) == f"cannot write {str(out / 'b.txt')!r}: No space left on device; no output file was changed"
    assert snapshot(out) == before  # a.txt moved, then put back with its old bytes


def test_a_full_disk_while_writing_is_one_line(out, monkeypatch):
    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    before = snapshot(out)
    with pytest.raises(FFNQuantError, match=r"^cannot write the outputs in .*: No space left on device; "
                                            r"no output file was changed$"):
        with OutputTransaction() as tx:
            write_text(tx.folder(out) / "a.txt", "new a\n")
            full(tx.folder(out) / "b.txt", b"")
    assert snapshot(out) == before


def test_other_oserrors_pass_through_unchanged(out):
    before = snapshot(out)
    with pytest.raises(FileNotFoundError):
        with OutputTransaction() as tx:
            tx.folder(out)
            open(out / "missing-input.txt")
    assert snapshot(out) == before


def test_atomic_path_alone_leaves_no_temporary_file_on_interrupt(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(tmp_path / "x.onnx") as tmp:
            assert tmp.name.startswith(".x.onnx.ffnq-") and tmp.parent == tmp_path
            tmp.write_bytes(b"half")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def _turned_into_error() -> None:
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs here
    except KeyboardInterrupt:
        raise RuntimeError("an import cut short") from None


def _swallowed() -> None:
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    except KeyboardInterrupt:
        pass


@pytest.fixture
def sigint_delivered():
    """Ctrl-C delivered as at a terminal: a suite started as a background job inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("library", [_turned_into_error, _swallowed], ids=["turned-into-error", "swallowed"])
def test_ctrl_c_that_a_library_hides_is_still_an_interruption(out, library, sigint_delivered):
    before = snapshot(out)
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with OutputTransaction() as tx:
            write_text(tx.folder(out) / "a.txt", "new a\n")
            library()
    assert snapshot(out) == before
    assert signal.getsignal(signal.SIGINT) is handler


# --- sweeping the leftovers of killed runs ----------------------------------------------------

def test_sweep_removes_only_our_stale_leftovers(tmp_path):
    host, hour = atomic._HOST, 3600.0
    dead, live = dead_pid(), os.getpid()
    stale, kept = [], []

    def make(name: str, *, folder: bool = False, marked: bool = False, old: float = 0.0, keep: bool) -> None:
        p = tmp_path / name
        if folder:
            p.mkdir()
            (p / "x.onnx").write_bytes(b"x")
            if marked:
                (p / atomic.STAGING_MARKER).write_bytes(b"")
        else:
            p.write_bytes(b"x")
        age(p, old)
        (kept if keep else stale).append(name)

    make(f"{STAGING_PREFIX}{host}-{dead}-abcd_123", folder=True, marked=True, keep=False)  # killed run of this host
    make(f"{STAGING_PREFIX}{host}-{dead}-nomark12", folder=True, old=50 * hour, keep=True)  # our name, no marker
    make(f".report.json.ffnq-{host}-{dead}-k2j4h5g6.tmp", keep=False)
    make(f"{STAGING_PREFIX}{host}-{live}-abcd_123", folder=True, marked=True, old=5 * hour, keep=True)  # still going
    make(f".report.json.ffnq-{host}-{live}-k2j4h5g6.tmp", old=5 * hour, keep=True)
    make(f"{STAGING_PREFIX}0badc0de-{dead}-abcd_123", folder=True, marked=True, old=2 * hour, keep=True)  # a day
    make(f"{STAGING_PREFIX}0badc0de-{dead}-efgh_456", folder=True, marked=True, old=30 * hour, keep=False)
    make(f".L0.rows.ffnq-{host}-{dead}-k2j4h5g6.tmp", keep=False)  # `model capture`'s raw rows
    # names without an owner part are a user's, however old and however like a temporary file (issue 27)
    for name in (".hidden", "notes.tmp", ".notes.tmp", "a.onnx", ".x.toolongrandom.tmp", "partial",
                 ".report.json.k2j4h5g6.tmp", ".draft.abcdefgh.tmp", ".model.abcdefgh.tmp", ".relu.w8a8.onnx.a1b2c3d4.tmp",
                 ".L0.rows.tmp", ".model.rows.tmp", "relu.w8a8.onnx.partial", "notes.onnx.partial"):
        make(name, old=50 * hour, keep=True)
    make(f".L1.rows.ffnq-{host}-{dead}-k2j4h5g6.tmp", folder=True, old=2 * hour, keep=True)  # a folder: no file
    os.symlink(tmp_path / "a.onnx", tmp_path / f".link.ffnq-{host}-{dead}-k2j4h5g6.tmp")  # nor does a link
    kept.append(f".link.ffnq-{host}-{dead}-k2j4h5g6.tmp")

    removed = sweep_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


# --- through the CLI ---------------------------------------------------------------------------

TINY_RUN = ["run", "--tiny", "--variants", "relu", "--runtimes", "none", "--no-sensitivity",
            "--calib-tokens", "256", "--eval-tokens", "128"]


def test_run_keeps_an_earlier_artifact_it_does_not_produce_and_replaces_one_it_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rep, exp = Path("R"), Path("E")
    # first run: plain w8a8 writes relu_d64_ff256.w8a8.onnx
    assert main([*TINY_RUN, "--schemes", "fp32,w8a8", "--out", str(rep), "--export", str(exp)]) == 0
    plain = (exp / "relu_d64_ff256.w8a8.onnx").read_bytes()
    (exp / "notes.bin").write_bytes(USER_BYTES)
    (exp / "relu_d64_ff256.w8a8-auto.onnx").write_bytes(b"stale bytes of an earlier run")
    # second run: w8a8@auto writes only relu_d64_ff256.w8a8-auto.onnx (directly under that name)
    assert main([*TINY_RUN, "--schemes", "fp32,w8a8@auto", "--out", str(rep), "--export", str(exp)]) == 0
    assert (exp / "relu_d64_ff256.w8a8.onnx").read_bytes() == plain
    assert (exp / "notes.bin").read_bytes() == USER_BYTES
    import json

    import onnx

    onnx.checker.check_model(str(exp / "relu_d64_ff256.w8a8-auto.onnx"))  # this run's artifact, not the stale bytes
    doc = json.loads((rep / "report.json").read_text())
    assert {a["path"] for a in doc["artifacts"]} == {"E/relu_d64_ff256.fp32.onnx", "E/relu_d64_ff256.w8a8-auto.onnx"}
    assert leftovers(rep, exp) == []


# Each writing command with its output folder option and a file it writes.
COMMANDS = {
    "export": (["export", "--variants", "relu", "--d-model", "32", "--dtypes", "fp32"], "--out", "relu_d32_ff128.fp32.onnx"),
    "profile": (["profile", "--variants", "relu", "--d-model", "32", "--tokens", "256", "--bins", "64"], "--out",
                "ranges.md"),
    "quantize": (["quantize", "--variants", "relu", "--d-model", "32", "--calib-tokens", "128", "--eval-tokens", "64"],
                 "--out-artifacts", "relu_d32_ff128.w8a8.onnx"),
    "bench": (["bench", "--variants", "relu", "--d-model", "32", "--runtimes", "torch-cpu", "--schemes", "fp32",
               "--tokens", "1", "--budget-s", "0.001", "--warmup", "0", "--min-repeats", "1", "--no-progress"],
              "--out", "latency.json"),
    "run": ([*TINY_RUN, "--schemes", "fp32,w8a8@auto", "--export", "{tmp}/E"], "--out", "report.html"),
}


def _command(name: str, tmp_path: Path) -> tuple[list[str], Path, str]:
    argv, flag, produced = COMMANDS[name]
    folder = tmp_path / "out"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv] + [flag, str(folder)]
    if name == "quantize":
        argv += ["--out-reports", str(tmp_path / "E")]
    return argv, folder, produced


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if ": error: " in line]


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_folder_where_an_output_goes_is_refused_and_nothing_changes(name, tmp_path, capsys):
    argv, folder, produced = _command(name, tmp_path)
    folder.mkdir()
    (folder / "notes.bin").write_bytes(USER_BYTES)
    (folder / produced).mkdir()
    before = snapshot(tmp_path)
    assert main(argv) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and produced in errors[0] and "folder of that name is in the way" in errors[0], errors
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name, last", [("export", ".fp16.onnx"), ("quantize", ".md"), ("run", "report.html")],
                         ids=["export", "quantize", "run"])
def test_a_full_disk_is_one_line_and_leaves_nothing(name, last, tmp_path, capsys, monkeypatch):
    argv, folder, _ = _command(name, tmp_path)
    argv = [a.replace("fp32", "fp32,fp16") if name == "export" else a for a in argv]
    folder.mkdir()
    (folder / "notes.bin").write_bytes(USER_BYTES)
    real = os.chmod

    def chmod(path, mode, *args, **kwargs):  # atomic_path's last step before its rename: the disk fills up there
        if f"{last}.ffnq-" in Path(path).name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(atomic.os, "chmod", chmod)
    before = snapshot(tmp_path)
    assert main(argv) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "No space left on device; no output file was changed" in errors[0], errors
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("name", ["export", "run"])
def test_a_full_disk_names_the_file_not_its_temporary_name(name, tmp_path, capsys, monkeypatch):
    import onnx

    argv, folder, _ = _command(name, tmp_path)

    def save(proto, path, *args, **kwargs):
        Path(path).write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(onnx, "save_model", save)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # `run` too: no progress bar left above the error
    art = folder / "relu_d32_ff128.fp32.onnx" if name == "export" else tmp_path / "E" / "relu_d64_ff256.fp32.onnx"
    assert err[0] == f"ffnquant {name}: error: cannot write {str(art)!r}: No space left on device; no output file was changed"
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def signals_delivered():
    """Ctrl-C and SIGTERM delivered as at a terminal, and the handlers `main` installs put back afterwards."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _signal_on_first_final_move(monkeypatch, sig: int) -> None:
    """The signal arrives while the final moves run (the first move out of staging): they are deferred past it."""
    real = os.replace
    sent = []

    def replace(src, dst, *args, **kwargs):
        if not sent and STAGING_PREFIX in str(src) and STAGING_PREFIX not in str(dst):
            sent.append(sig)
            os.kill(os.getpid(), sig)
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("sig, code, how", [(signal.SIGINT, 130, ""), (signal.SIGTERM, 143, " by SIGTERM")],
                         ids=["sigint", "sigterm"])
def test_interrupt_during_the_final_moves_says_the_new_files_are_in_place(tmp_path, capsys, monkeypatch, sig, code,
                                                                         how, signals_delivered):
    argv, folder, produced = _command("export", tmp_path)
    _signal_on_first_final_move(monkeypatch, sig)
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err == f"ffnquant export: interrupted{how} after the output was complete: the new files are in place"
    assert (folder / produced).is_file() and not leftovers(tmp_path)


def test_interrupt_during_a_folder_rename_marks_the_new_folder_in_place(tmp_path, monkeypatch, signals_delivered):
    target = tmp_path / "model"
    _signal_on_first_final_move(monkeypatch, signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as info:
        with atomic_folder.staged_folder(target) as content:
            (content / "w.bin").write_bytes(b"new")
    assert info.value.outputs_complete is True
    assert (target / "w.bin").read_bytes() == b"new" and not leftovers(tmp_path)


def test_interrupt_while_an_artifact_is_written_leaves_nothing(tmp_path, capsys, monkeypatch):
    import onnx

    argv, folder, _ = _command("export", tmp_path)
    argv[argv.index("fp32")] = "fp32,fp16"
    real = onnx.save_model

    def save(proto, path, *args, **kwargs):
        if str(path).endswith(".tmp") and Path(folder).exists() and any(folder.rglob("*.fp32.onnx")):
            Path(path).write_bytes(b"")  # Ctrl-C with the second file half written
            raise KeyboardInterrupt
        return real(proto, path, *args, **kwargs)

    monkeypatch.setattr(onnx, "save_model", save)
    assert main(argv) == 130
    assert capsys.readouterr().err.strip() == "ffnquant export: interrupted; no partial files were left"
    assert not folder.exists()


def test_a_run_sweeps_stale_leftovers_of_killed_runs(tmp_path):
    argv, folder, produced = _command("export", tmp_path)
    folder.mkdir()
    killed = folder / f"{STAGING_PREFIX}{atomic._HOST}-{dead_pid()}-abcd_123"
    killed.mkdir()
    (killed / produced).write_bytes(b"half")
    (killed / atomic.STAGING_MARKER).write_bytes(b"")
    dead = folder / f".{produced}.ffnq-{atomic._HOST}-{dead_pid()}-k2j4h5g6.tmp"
    dead.write_bytes(b"")
    # names without an owner are a user's, however old (issue 27): a notes file, a draft, a partial download
    users = [folder / ".draft.abcdefgh.tmp", folder / "notes.onnx.partial", folder / ".model.rows.tmp"]
    for u in users:
        u.write_bytes(USER_BYTES)
        age(u, 7200)
    assert main(argv) == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted([produced, *(u.name for u in users)])
    assert all(u.read_bytes() == USER_BYTES for u in users)


@pytest.mark.parametrize("name", ["../escaped", "", ".hidden", "a/b", "x" * 129, "lat ency"],
                         ids=["parent", "empty", "hidden", "slash", "too-long", "space"])
def test_bench_name_must_be_a_plain_file_stem(name, tmp_path, capsys):
    argv, folder, _ = _command("bench", tmp_path)
    assert main(argv + ["--name", name]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a plain file stem; valid: 1-128 letters, digits" in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_model_eval_report_is_staged_and_named_after_the_whole_folder(tmp_path, capsys):
    import numpy as np

    from hf_models import D, write_llama_like

    model = tmp_path / "m-1.5b"  # the dot once cut the name short (Path.with_suffix): model-m-1.json
    write_llama_like(model)
    gen = np.random.default_rng(0)
    for split in ("calib", "eval"):
        (tmp_path / split).mkdir()
        for label in ("L0", "L1"):
            np.save(tmp_path / split / f"{label}.npy", gen.standard_normal((128, D)).astype(np.float32))
    out = tmp_path / "out"
    argv = ["model", "eval", str(model), "--schemes", "w8a8-dynamic", "--calib-captured", str(tmp_path / "calib"),
            "--eval-captured", str(tmp_path / "eval"), "--out", str(out)]
    out.mkdir()
    (out / "model-m-1.5b.md").mkdir()  # in the way: refused, nothing written
    before = snapshot(out)
    assert main(argv) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "model-m-1.5b.md" in errors[0] and "in the way" in errors[0], errors
    assert snapshot(out) == before
    (out / "model-m-1.5b.md").rmdir()
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model-m-1.5b.json", "model-m-1.5b.md"]
    assert f"wrote {out / 'model-m-1.5b.json'} and {out / 'model-m-1.5b.md'}" in capsys.readouterr().out


@pytest.mark.hf
def test_model_capture_stages_its_files(tmp_path_factory, tmp_path, capsys):
    from hf_models import tiny_folders

    folder = tiny_folders(tmp_path_factory, ("opt",))["opt"][0]
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.bin").write_bytes(USER_BYTES)
    (out / "L1.npy").mkdir()  # in the way: refused after the capture, nothing written
    argv = ["model", "capture", str(folder), "--out", str(out), "--max-tokens", "64", "--seq-len", "16"]
    before = snapshot(out)
    assert main(argv) == 2
    errors = _error_lines(capsys.readouterr().err)
    assert len(errors) == 1 and "L1.npy" in errors[0], errors
    assert snapshot(out) == before
    (out / "L1.npy").rmdir()
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["L0.npy", "L1.npy", "notes.bin"]
    assert str(out / "L0.npy") in capsys.readouterr().out


# --- staged_folder: a whole folder renamed into place --------------------------------------------

def test_staged_folder_appears_whole_or_not_at_all(tmp_path):
    target = tmp_path / "model-q"
    with atomic_folder.staged_folder(target) as stage:
        (stage / "config.json").write_text("{}")
        assert not target.exists()
    assert (target / "config.json").read_text() == "{}"
    assert [p.name for p in tmp_path.iterdir()] == ["model-q"]


@pytest.mark.parametrize("exc", [RuntimeError("bug"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_staged_folder_failure_leaves_the_old_folder_untouched(tmp_path, exc):
    target = tmp_path / "model-q"
    target.mkdir()
    (target / "mine.txt").write_text("user")
    with pytest.raises(type(exc)):
        with atomic_folder.staged_folder(target, force=True) as stage:
            (stage / "config.json").write_text("{}")
            raise exc
    assert [p.name for p in target.iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-q"]


def test_a_non_empty_folder_needs_force_and_force_replaces_it(tmp_path):
    target = tmp_path / "model-q"
    target.mkdir()
    (target / "old.safetensors").write_text("x")
    with pytest.raises(FFNQuantError, match="exists and is not empty.*--force"):
        with atomic_folder.staged_folder(target):
            pass
    with atomic_folder.staged_folder(target, force=True) as stage:
        (stage / "new.safetensors").write_text("y")
    assert [p.name for p in target.iterdir()] == ["new.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model-q"]


def test_staged_folder_sweeps_only_our_leftovers_beside_it(tmp_path):
    """export --out dep sweeps the folder above dep: a user's `weights.onnx.partial` there stays (issue 27)."""
    mine = tmp_path / "weights.onnx.partial"
    mine.write_bytes(USER_BYTES)
    age(mine, 5 * 3600.0)
    with atomic_folder.staged_folder(tmp_path / "dep") as stage:
        (stage / "config.json").write_text("{}")
    assert mine.read_bytes() == USER_BYTES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dep", "weights.onnx.partial"]


@pytest.mark.parametrize("files, listed, refused", [
    pytest.param(["model.onnx", "ffnquant-deploy.json"], ["model.onnx"], None, id="an-earlier-export"),
    pytest.param(["model.onnx", "ffnquant-deploy.json", "notes.txt"], ["model.onnx"], "notes.txt", id="plus-a-user-file"),
    pytest.param(["model.onnx", "sub/q.bin"], None, "model.onnx, sub/q.bin", id="no-listing"),
    pytest.param(["model.onnx", "ffnquant-deploy.json"], "garbage", "model.onnx", id="unreadable-listing"),
])
def test_force_replaces_only_what_the_listing_names(tmp_path, files, listed, refused):
    target = tmp_path / "dep"
    for f in files:
        (target / f).parent.mkdir(parents=True, exist_ok=True)
        (target / f).write_bytes(USER_BYTES)
    if listed is not None:
        doc = {"files": listed + ["ffnquant-deploy.json"]} if isinstance(listed, list) else listed
        (target / "ffnquant-deploy.json").write_text(json.dumps(doc) if isinstance(listed, list) else doc)
    before = sorted(p.relative_to(target).as_posix() for p in target.rglob("*"))
    if refused is None:
        with atomic_folder.staged_folder(target, force=True, listing="ffnquant-deploy.json") as stage:
            (stage / "new.onnx").write_bytes(b"new")
        assert [p.name for p in target.iterdir()] == ["new.onnx"]
    else:
        with pytest.raises(FFNQuantError, match=f"also holds {refused}") as info:
            with atomic_folder.staged_folder(target, force=True, listing="ffnquant-deploy.json"):
                pass
        assert "\n" not in str(info.value)
        assert sorted(p.relative_to(target).as_posix() for p in target.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dep"]


def test_an_empty_folder_is_replaced_without_force_and_a_file_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with atomic_folder.staged_folder(tmp_path / "empty") as stage:
        (stage / "a").write_text("1")
    assert (tmp_path / "empty" / "a").is_file()
    (tmp_path / "file").write_text("x")
    with pytest.raises(FFNQuantError, match="not a folder"):
        atomic_folder.check_new_folder(tmp_path / "file")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_parent_is_refused_before_work(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(FFNQuantError, match="not writable"):
            atomic_folder.check_new_folder(ro / "out")
    finally:
        ro.chmod(0o755)


def test_a_parent_that_refuses_writes_is_one_line_even_for_root(tmp_path, monkeypatch):
    """Root writes through mode bits: what a read-only destination reports is checked by faking os.access."""
    monkeypatch.setattr(atomic.os, "access", lambda path, mode: False)
    with pytest.raises(FFNQuantError, match=r"cannot write output folder .* is not writable"):
        atomic_folder.check_new_folder(tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("umask", [0o022, 0o077], ids=["umask-022", "umask-077"])
def test_staged_folder_gives_every_file_the_umask_mode(tmp_path, umask):
    # transformers' save_pretrained writes model.safetensors 0600; a served folder must follow the user's umask
    from ffnquant.infra.atomic_folder import staged_folder

    old = os.umask(umask)
    try:
        with staged_folder(tmp_path / "dep") as folder:
            (folder / "model.safetensors").write_bytes(b"x")
            os.chmod(folder / "model.safetensors", 0o600)
            (folder / "sub").mkdir(mode=0o700)
            (folder / "sub" / "config.json").write_text("{}")
    finally:
        os.umask(old)
    out = tmp_path / "dep"
    assert stat.S_IMODE(os.stat(out / "model.safetensors").st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(out / "sub").st_mode) == 0o777 & ~umask
    assert stat.S_IMODE(os.stat(out / "sub" / "config.json").st_mode) == 0o666 & ~umask
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask


def test_scratch_folder_a_killed_run_leaves_is_removed_by_the_next_run(tmp_path):
    """A run killed (SIGKILL) while it holds a scratch folder leaves it behind, marked as ours: the next run that
    makes one there removes it, and keeps a user's folders of like names."""
    code = ("import os, signal, sys; from ffnquant.infra.atomic import ScratchFolder; "
            "f = ScratchFolder('bench', dir=sys.argv[1]); open(os.path.join(f.name, 'case.onnx'), 'wb').write(b'x'); "
            "print(f.name, flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    left = Path(proc.stdout.strip())
    assert (left / "case.onnx").is_file() and left.parent.name.startswith(STAGING_PREFIX)
    # a user's folders: one of our name but without our marker, one like the old tempfile names
    mimic = tmp_path / (left.parent.name[:-8] + "usercopy")  # the dead run's owner tag, no marker
    mimic.mkdir()
    (mimic / "mine.txt").write_bytes(USER_BYTES)
    (tmp_path / "ffnquant_bench_abcd1234").mkdir()
    with atomic.ScratchFolder("bench", dir=tmp_path) as folder:
        assert folder.is_dir() and not any(folder.iterdir())  # the marker stays outside the folder handed out
        assert not left.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mimic.name, "ffnquant_bench_abcd1234"])
    assert (mimic / "mine.txt").read_bytes() == USER_BYTES


@pytest.mark.parametrize("how", ["with-block", "cleanup", "garbage-collected"])
def test_scratch_folder_is_removed_when_done(tmp_path, how):
    if how == "with-block":
        with atomic.ScratchFolder("x", dir=tmp_path) as folder:
            (folder / "f").write_bytes(b"1")
    else:
        scratch = atomic.ScratchFolder("x", dir=tmp_path)
        (Path(scratch.name) / "f").write_bytes(b"1")
        if how == "cleanup":
            scratch.cleanup()
        else:
            del scratch
    assert list(tmp_path.iterdir()) == []


def test_process_scratch_is_one_marked_folder_for_the_process():
    from ffnquant.infra.atomic import process_scratch

    a, b = process_scratch("test-artifacts"), process_scratch("test-artifacts")
    assert a == b and a.is_dir()
    # inside a marked staging folder, so a killed run's is swept by the next run
    assert a.parent.name.startswith(atomic.STAGING_PREFIX)
