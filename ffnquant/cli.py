"""Command-line entry point: `ffnquant <command>`; each command lives in `ffnquant/commands/<name>.py`.

This is the one place that prints for the commands; library functions return data.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from . import __version__
from .errors import FFNQuantError, Interrupted, debug_enabled, internal_error_line
from .infra.thirdparty import quiet_bitsandbytes

__all__ = ["COMMANDS", "build_parser", "main"]

# Each module defines NAME, HELP, add_arguments(parser) and run(args) -> int.
COMMANDS: tuple[str, ...] = (
    "variants",
    "export",
    "profile",
    "quantize",
    "plan",
    "run",
    "bench",
    "model",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2 (argparse's own code too)
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ffnquant", description="Quantize and deploy transformer FFN layers.")
    parser.add_argument("--version", action="version", version=f"ffnquant {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an internal error (a bug to report) instead of one line; "
                             "FFNQUANT_DEBUG=1 does the same")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"ffnquant.commands.{name}")
        # argparse %-formats a subcommand's help line (not its description): a literal % must be doubled
        p = sub.add_parser(module.NAME, help=module.HELP.replace("%", "%%"), description=module.HELP)
        module.add_arguments(p)
        # after the command too (`ffnquant plan ... --debug`); SUPPRESS keeps one given before it
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        p.set_defaults(_run=module.run)
    return parser


def _handle_termination() -> None:
    """SIGTERM and SIGHUP end a command like Ctrl-C: an exception that unwinds the work, so staging folders and
    temporary folders are removed and the output folders stay as they were (the OS default kills at once)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return

    def raise_interrupted(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:  # an ignored SIGHUP (nohup) stays ignored
            signal.signal(sig, raise_interrupted)


def _interrupted_line(exc: KeyboardInterrupt, command: str | None) -> tuple[str, int]:
    """The one line and exit code for an interruption (128 + the signal, as a shell reports it)."""
    import signal

    signum = int(getattr(exc, "signum", signal.SIGINT))
    how = "" if signum == signal.SIGINT else f" by {signal.Signals(signum).name}"
    who = f"ffnquant {command}" if command else "ffnquant"
    if command is None:
        return f"{who}: interrupted{how}", 128 + signum
    if getattr(exc, "outputs_complete", False):
        # it came while the final moves ran, which finish first: the new outputs are all in place
        return f"{who}: interrupted{how} after the output was complete: the new files are in place", 128 + signum
    return f"{who}: interrupted{how}; no partial files were left", 128 + signum


def _quiet_exit() -> None:
    """The work is done and its exit code chosen: a Ctrl-C from here to the end of the interpreter (its shutdown
    can take a while with torch loaded) is ignored, so it cannot print a KeyboardInterrupt traceback."""
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; the exit code. Called without `argv` it is the program itself (the console script,
    `python -m ffnquant`), which also keeps a late Ctrl-C quiet."""
    try:
        code = _main(argv)
    except KeyboardInterrupt as exc:  # at start-up (importing torch, building the parser): before any command
        line, code = _interrupted_line(exc, None)
        print(line, file=sys.stderr)
    if argv is None:
        _quiet_exit()
    return code


def _main(argv: Sequence[str] | None) -> int:
    _handle_termination()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and argparse's own errors: return the code
        return int(exc.code or 0)
    # Third-party noise stays out of the user's terminal: bitsandbytes asks at import to `pip install
    # kernels`, a package ffnquant does not use, wherever it is imported (runtimes, primitives).

    quiet_bitsandbytes()
    # The exact command line, for reports that state how they were made.
    args._argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # --device (plan, export, quantize --model, model eval, profile --model): checked before any model is
        # read, and where the engine computes for the whole command
        # --target-model: the model a draft model is run through (`hf.draft`, `infra.target_model`), checked likewise
        from .infra.target_model import use_target
        from .infra.device import use_device

        with use_device(getattr(args, "device", None) or "cpu"), use_target(getattr(args, "target_model", None)):
            return int(args._run(args) or 0)
    except FFNQuantError as exc:
        print(f"ffnquant {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        line, code = _interrupted_line(exc, args.command)
        print(line, file=sys.stderr)
        return code
    except BrokenPipeError:
        # the reader went away (`ffnquant model inspect PATH | head`): stop quietly, no traceback;
        # stdout is pointed at devnull so that the interpreter's final flush does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # a bug: one line naming the step and the input, the traceback only when asked
        if args.debug or debug_enabled():
            import traceback

            traceback.print_exc()
        else:
            print(internal_error_line(exc, f"ffnquant {args.command}", _input_of(args)), file=sys.stderr)
        return INTERNAL_ERROR


INTERNAL_ERROR = 3  # exit code of a bug in ffnquant (2 is a user's bad input, 1 a result that misses its target)


def _input_of(args: argparse.Namespace) -> str | None:
    """The input a command was reading, for the internal-error line: the model, plan, config or captured folder."""
    for name in ("model", "plan", "config", "captured", "path", "variants"):
        value = getattr(args, name, None)
        if isinstance(value, (str, os.PathLike)) and str(value):
            return f"{'--' + name if name != 'path' else 'input'} {str(value)!r}"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
