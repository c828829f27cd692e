import subprocess
import sys

import pytest

from ffnquant.cli import COMMANDS, main


def test_variants_prints_the_family(capsys):
    assert main(["variants", "--d-model", "512"]) == 0
    out = capsys.readouterr().out
    for name in ["relu", "gelu_tanh", "swiglu", "bilinear"]:
        assert name in out
    assert "2,099,712" in out  # the 2017 ReLU FFN at d=512


def test_export_command_writes_and_reports_parity(tmp_path, capsys):
    assert main(["export", "--variants", "swiglu", "--d-model", "32", "--out", str(tmp_path), "--dtypes", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "pass" in out and "CPUExecutionProvider" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["swiglu_d32_ff128.fp32.onnx"]


@pytest.mark.parametrize(
    "argv, message",
    [
        pytest.param(["export", "--variants", "relu,swigl"], "unknown variant 'swigl'; valid:", id="variant"),
        pytest.param(["export", "--dtypes", "fp8"], "unknown dtype(s) ['fp8']; valid: fp32, fp16", id="dtype"),
        pytest.param(["export", "--opset", "11"], "--opset must be >= 17", id="opset"),
        pytest.param(["export", "--d-ff", "10", "--ffn-dim-multiplier", "1.3"], "exclusive", id="width"),
        pytest.param(["variants", "--d-model", "-3"], "expected a positive integer", id="d-model"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(argv, message, tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert main(argv + (["--out", str(out_dir)] if argv[0] == "export" else [])) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert len(err.splitlines()) == 1
    assert not out_dir.exists()


def test_unwritable_output_folder(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["export", "--variants", "relu", "--d-model", "16", "--out", str(blocker / "sub")]) == 2
    assert "cannot create output folder" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert command in capsys.readouterr().out


def _all_parsers(parser, prog=("ffnquant",)):
    """(argv prefix, parser) for the top-level parser and every subcommand's, nested ones included."""
    import argparse

    yield list(prog[1:]), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _all_parsers(child, prog + (name,))


def _help_ids():
    from ffnquant.cli import build_parser

    return [" ".join(argv) or "top" for argv, _ in _all_parsers(build_parser())]


@pytest.mark.parametrize("path", _help_ids())
def test_every_help_text_renders(path, capsys):
    # argparse %-formats help strings only when --help is asked: a stray % crashed `ffnquant --help`
    argv = [] if path == "top" else path.split()
    assert main(argv + ["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: ffnquant")


def test_console_script_help_runs():
    # the first command the README gives a user, as the installed entry point runs it
    proc = subprocess.run([sys.executable, "-m", "ffnquant", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    for command in COMMANDS:
        assert command in proc.stdout


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "ffnquant", "--version"], capture_output=True, text=True, check=True)
    assert proc.stdout.startswith("ffnquant ")


def _help_defaults():
    """(command, option, the default its help states, the default the code uses) for every '(default X)'."""
    import re

    from ffnquant.cli import build_parser
    from ffnquant.commands import run as run_cmd
    from ffnquant.commands.common import format_default
    from ffnquant.pipeline import RunConfig
    from ffnquant.spec import Variant

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    out = []
    for name, p in sub.choices.items():
        for action in p._actions:
            for stated in re.findall(r"\(default ([^):]+)\)|; default (\S+)$", action.help or ""):
                stated = next(s for s in stated if s).replace("%%", "%")  # argparse help is %-formatted
                value = action.default
                if value is None and name == "run" and action.dest in run_cmd._FIELDS:
                    value = RunConfig.__dataclass_fields__[run_cmd._FIELDS[action.dest]].default
                if isinstance(value, tuple) and set(value) == {v.value for v in Variant}:
                    value = "all"
                out.append(pytest.param(stated.rstrip("/"), format_default(value).rstrip("/"),
                                        id=f"{name}{action.option_strings[0] if action.option_strings else action.dest}"))
    return out


@pytest.mark.parametrize("stated, actual", _help_defaults())
def test_every_help_default_is_the_codes_default(stated, actual):
    """A help text that names a default must name the one the code uses (run's came from RunConfig by hand)."""
    assert stated == actual


def test_cli_keeps_bitsandbytes_pip_install_kernels_warning_off_stderr(tmp_path):
    """A 4-bit scheme's reference numerics import bitsandbytes (ffnquant.numerics.primitives), which logs at import a
    request to `pip install kernels`, a package ffnquant does not use: the command's stderr has no such line."""
    pytest.importorskip("bitsandbytes")
    proc = subprocess.run(
        [sys.executable, "-m", "ffnquant", "quantize", "--variants", "swiglu", "--d-model", "64", "--scheme", "nf4",
         "--no-onnx", "--calib-tokens", "64", "--eval-tokens", "64", "--out-reports", str(tmp_path / "r"),
         "--out-artifacts", str(tmp_path / "e")],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "pip install kernels" not in proc.stderr and "kernels-community" not in proc.stderr


def test_a_closed_pipe_ends_the_command_quietly():
    """`ffnquant variants | head -1`: the reader goes away; no traceback on stderr (was BrokenPipeError)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "ffnquant", "variants", "--d-model", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader is gone before the table is written
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_install_hints_name_the_checkout_not_a_registry_package():
    """`ffnquant` is not on the package registry: every extra is installed from the checkout (`pip install ".[hf]"`)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    needle = "ffnquant" + "["  # spelled apart so that this line is not an offender
    files = [root / "README.md", *sorted((root / "ffnquant").rglob("*.py")), *sorted((root / "tests").glob("*.py"))]
    offenders = [f"{f.relative_to(root)}:{n}" for f in files
                 for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
                 if "install" in line and needle in line.replace('"', "").replace("'", "")]
    assert offenders == []


def _interruptible() -> None:
    """In the child: Ctrl-C as at a terminal (a suite run as a background job inherits SIGINT ignored)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


# How the program starts: the console script's own lines, and `python -m ffnquant`.
CONSOLE_SCRIPT = "import sys; from ffnquant.cli import main; sys.argv[0] = 'ffnquant'; sys.exit(main())"


@pytest.mark.parametrize("start", [[sys.executable, "-c", CONSOLE_SCRIPT], [sys.executable, "-m", "ffnquant"]],
                         ids=["console-script", "python-m"])
def test_ctrl_c_at_start_up_is_one_line_not_a_traceback(start):
    """A real SIGINT while the command is still importing torch (seen in /proc as torch's library being mapped),
    before any command runs: one line, exit 130."""
    import os
    import signal
    import time

    proc = subprocess.Popen([*start, "variants"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_interruptible)
    maps = f"/proc/{proc.pid}/maps"
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with open(maps) as f:
                if "libtorch" in f.read():
                    break
        except OSError:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err
    if proc.returncode != 0:  # 0: the command had already finished (a fast machine); still no traceback
        assert proc.returncode == 130, err
        assert err.strip() == "ffnquant: interrupted", err


def test_ctrl_c_after_the_work_is_done_keeps_the_exit_code_and_prints_no_traceback():
    """A Ctrl-C once main has returned (the interpreter shutting down) is ignored: main's exit code, no traceback."""
    late = ("import os, signal, sys, time; from ffnquant.cli import main; sys.argv = ['ffnquant', 'variants']; "
            "code = main(); os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2); sys.exit(code)")
    proc = subprocess.run([sys.executable, "-c", late], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120, preexec_fn=_interruptible)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and proc.stderr == "", proc.stderr


def test_main_called_with_arguments_leaves_ctrl_c_alone(capsys):
    """Code that calls main(argv) (tests, scripts) keeps its Ctrl-C: only the program itself ignores a late one."""
    import signal

    handler = signal.getsignal(signal.SIGINT)
    assert main(["variants", "--d-model", "32"]) == 0
    assert signal.getsignal(signal.SIGINT) is handler


# --- an unexpected exception is one line naming the step and input; the traceback only when asked ----------------
_ARGV = {"variants": ["variants"], "export": ["export"], "profile": ["profile"], "quantize": ["quantize"],
         "plan": ["plan", "--model", "some/model"], "run": ["run"], "bench": ["bench"],
         "model": ["model", "inspect", "some/model"]}


def _inject(monkeypatch, command):
    import importlib

    def broken_step(args):
        raise RuntimeError("internal detail\nthat must not reach a user")

    monkeypatch.setattr(importlib.import_module(f"ffnquant.commands.{command}"), "run", broken_step)


@pytest.mark.parametrize("command", COMMANDS)
def test_an_internal_error_in_each_command_is_one_line_with_a_hint_to_report_it(command, monkeypatch, capsys):
    assert set(_ARGV) == set(COMMANDS)  # a new command gets its case here
    monkeypatch.delenv("FFNQUANT_DEBUG", raising=False)
    _inject(monkeypatch, command)
    assert main(_ARGV[command]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "internal detail" not in err
    assert err.startswith(f"ffnquant {command} failed")
    assert "internal error (RuntimeError in ffnquant.cli._main via test_cli.broken_step)" in err
    assert "please report it" in err and "--debug or FFNQUANT_DEBUG=1" in err
    if command in ("plan", "model"):
        assert "'some/model'" in err  # the input it was reading


@pytest.mark.parametrize("how", ["flag-before", "flag-after", "environment"])
def test_debug_shows_the_traceback(how, monkeypatch, capsys):
    _inject(monkeypatch, "plan")
    argv = _ARGV["plan"]
    if how == "environment":
        monkeypatch.setenv("FFNQUANT_DEBUG", "1")
    else:
        monkeypatch.delenv("FFNQUANT_DEBUG", raising=False)
        argv = ["--debug", *argv] if how == "flag-before" else [*argv, "--debug"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "Traceback" in err and "internal detail" in err


def test_the_api_turns_an_internal_error_into_one_line(monkeypatch):
    import ffnquant
    from ffnquant import wholemodel
    from ffnquant.errors import FFNQuantError

    monkeypatch.delenv("FFNQUANT_DEBUG", raising=False)

    def broken(model, tokenizer=None):
        raise KeyError("internal detail")

    monkeypatch.setattr(wholemodel, "_model_info", broken)
    with pytest.raises(FFNQuantError) as info:
        ffnquant.apply("some/model", "w8a16")
    text = str(info.value)
    assert text.startswith("ffnquant.apply failed on 'some/model': an internal error (KeyError in ")
    assert "internal detail" not in text and "\n" not in text and "please report it" in text
    monkeypatch.setenv("FFNQUANT_DEBUG", "1")
    with pytest.raises(KeyError, match="internal detail"):
        ffnquant.apply("some/model", "w8a16")
