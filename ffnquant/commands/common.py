"""Argument helpers shared by the subcommands, so every command parses sizes and variants alike."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import FFNQuantError
from ..hf.corpus import DEFAULT_SEQ_LEN, TextSource, source_items
from ..infra import arguments
from ..infra.progress import StageLines
from ..infra.resources import parse_size
from ..spec import FFNSpec, Variant, parse_variants

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo

__all__ = ["add_spec_arguments", "specs_from_args", "positive_int", "add_model_arguments",
           "TextFiles", "token_notes", "add_text_arguments", "TextOptions", "text_options", "text_files", "StageBars", "memory_size", "add_memory_arguments"]


def positive_int(text: str) -> int:
    """A positive count, as an argparse type: the check the Python API makes (`infra.arguments.count`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    try:
        return arguments.count(value, "the value")
    except FFNQuantError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}") from None


def add_spec_arguments(
    parser: argparse.ArgumentParser, default_variants: str | None = "all", default_note: str | None = None
) -> None:
    """--variants, --d-model, --d-ff, --multiple-of, --ffn-dim-multiplier, --bias/--no-bias, --seed."""
    valid = ", ".join(v.value for v in Variant)
    note = default_note or f"default {default_variants}"
    parser.add_argument("--variants", default=default_variants, help=f"comma-separated variants or 'all' ({valid}); {note}")
    parser.add_argument("--d-model", type=positive_int, default=512, help="model width d (default 512)")
    parser.add_argument("--d-ff", type=positive_int, default=None, help="FFN width (default: the width rule)")
    parser.add_argument("--multiple-of", type=positive_int, default=None, help="round gated d_ff up to this (by default 128 for gated variants, 1 otherwise)")
    parser.add_argument("--ffn-dim-multiplier", type=float, default=None, help="Llama 3's multiplier on the gated width")
    bias = parser.add_mutually_exclusive_group()
    bias.add_argument("--bias", dest="bias", action="store_true", default=None, help="force biases on")
    bias.add_argument("--no-bias", dest="bias", action="store_false", help="force biases off")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")


def specs_from_args(args: argparse.Namespace) -> list[FFNSpec]:
    """The FFNSpecs the arguments describe, validated."""
    variants = parse_variants(args.variants)
    if args.d_ff is not None and args.ffn_dim_multiplier is not None:
        raise FFNQuantError("--d-ff and --ffn-dim-multiplier are exclusive: give the width or the rule's multiplier")
    return [
        FFNSpec(
            v,
            d_model=args.d_model,
            d_ff=args.d_ff,
            bias=args.bias,
            multiple_of=args.multiple_of,
            ffn_dim_multiplier=args.ffn_dim_multiplier,
        )
        for v in variants
    ]


class TextFiles(argparse.Action):
    """--text FILE, repeatable and comma-separated: every file given, in order, as one comma-separated string
    (what RunConfig and `hf.capture.read_text` take); all of them are read."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parts = [p.strip() for p in str(values).split(",") if p.strip()]
        if not parts:
            raise argparse.ArgumentError(self, "expected a file name (several: repeat the option or comma-separate)")
        previous = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, ",".join(([previous] if previous else []) + parts))


def token_notes(budgets) -> list[str]:
    """One line per text that gave fewer tokens than requested (`hf.inputs.token_budget` dicts)."""
    return [f"note: {b['note']}" for b in budgets if b and b.get("short")]


def add_model_arguments(
    parser: argparse.ArgumentParser,
    *,
    captured: bool = True,
    model_tokens: bool = True,
    eval_text: bool = False,
    allow_pickle: bool = True,
    layers_default: str | None = "all",
) -> None:
    """--model PATH and its calibration options: a local Hugging Face folder's FFN layers.

    The keywords leave out what a command does not take (`run` has no captured files and keeps
    every option None when not given, so that its --config file is not overridden).
    """
    group = parser.add_argument_group("real model (a local Hugging Face folder)")
    group.add_argument("--model", default=None, metavar="PATH",
                       help="also take the FFN layers of this model folder (config.json + safetensors)")
    group.add_argument("--layers", default=layers_default,
                       help="model layers: all, a range 0-3 or a list 0,5,7 (every layer when not given)")
    group.add_argument("--text", default=None, metavar="FILE", action=TextFiles,
                       help="calibration text run through the model; several files: repeat the option or "
                            "comma-separate them, all are used (default: the shipped public-domain sample)")
    if eval_text:
        group.add_argument("--eval-text", default=None, metavar="FILE", action=TextFiles,
                           help="held-out evaluation text, never used for calibration; several files: repeat the "
                                "option or comma-separate them (default: the shipped sample from another book)")
    if captured:
        group.add_argument("--captured", default=None, metavar="DIR",
                           help="captured FFN inputs (from `ffnquant model capture`) instead of running the model")
    if model_tokens:
        group.add_argument("--model-tokens", type=positive_int, default=4096,
                           help="calibration tokens taken from the model (default 4096)")
    if allow_pickle:
        group.add_argument("--allow-pickle", action="store_true",
                           help="allow .bin/.pt checkpoints (read with torch.load(weights_only=True))")


def memory_size(text: str) -> int:
    """A size in bytes from '8GB', '512MiB', ... (`resources.parse_size`), as an argparse type."""
    try:
        return parse_size(text)  # what `infra.arguments.size` reads for the Python API's max_memory
    except FFNQuantError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """--max-memory SIZE and --sequential/--no-sequential: how a --model run fits in memory (`hf.memory.plan_memory`)."""
    group = parser.add_argument_group("memory (a --model run)")
    group.add_argument("--max-memory", type=memory_size, default=None, metavar="SIZE",
                       help="memory the run may use in all, e.g. 8GB or 6GiB (default: what the process holds plus "
                            "what the machine has available); a model that does not fit in float32 is run one decoder "
                            "layer at a time, and its hidden states go to a temporary folder when they do not fit either")
    mode = group.add_mutually_exclusive_group()
    mode.add_argument("--sequential", dest="sequential", action="store_true", default=None,
                      help="read the model's decoder layers from its safetensors one at a time even when it fits (any "
                           "causal LM from safetensors; routed experts transformers fuses as it loads are made from "
                           "the per-expert tensors on disk, a layer at a time)")
    mode.add_argument("--no-sequential", dest="sequential", action="store_false",
                      help="keep the whole model in memory (refused when it does not fit); the same engine and figures")


def add_text_arguments(parser: Any, calib_help: str, eval_help: str, eval_tokens: int = 2048) -> None:
    """--text/--eval-text (repeatable, comma-separated files or shipped corpus names), --calib-tokens or
    --calib-samples, --eval-tokens, --seq-len and --chat-template for a command that runs a model on a calibration
    (search) text and a held-out text (`text_options` turns them into what the library takes)."""
    sources = ("a shipped corpus (prose, code; prose:evaluation names the split), a text file (a form feed separates "
               "documents), JSONL ('text' field), parquet or a datasets save_to_disk folder")
    parser.add_argument("--text", default=None, metavar="SOURCE", action=TextFiles,
                        help=f"{calib_help}: {sources}; several: repeat or comma-separate (default: the shipped prose "
                             "corpus' calibration split)")
    parser.add_argument("--eval-text", default=None, metavar="SOURCE", action=TextFiles,
                        help=f"{eval_help}, the same kinds (default: the shipped prose corpus' evaluation split)")
    budget = parser.add_mutually_exclusive_group() if hasattr(parser, "add_mutually_exclusive_group") else parser
    budget.add_argument("--calib-tokens", type=positive_int, default=None, help="calibration tokens; 4096 when neither this nor --calib-samples is given")
    budget.add_argument("--calib-samples", type=positive_int, default=None, metavar="N",
                        help="calibration sequences instead: a budget of N x --seq-len tokens")
    parser.add_argument("--eval-tokens", type=positive_int, default=eval_tokens,
                        help=f"held-out tokens (default {eval_tokens})")
    parser.add_argument("--seq-len", type=positive_int, default=None, metavar="L",
                        help=f"tokens per sequence: {DEFAULT_SEQ_LEN} unless given, or the model's context if shorter; each "
                             "starts at a document's start with the tokenizer's BOS where it adds one")
    parser.add_argument("--chat-template", action="store_true",
                        help="render every document through the tokenizer's chat template (instruct models; JSONL "
                             "rows may carry 'messages'); refused when the tokenizer has none")


@dataclass(frozen=True)
class TextOptions:
    """What `add_text_arguments` asked for, resolved against the model: texts (TextSources with --chat-template),
    the sequence length (no longer than the model's context) and the calibration token budget."""

    text: Any
    eval_text: Any
    seq_len: int
    calib_tokens: int
    eval_tokens: int


def text_options(args: argparse.Namespace, info: ModelInfo | None = None) -> TextOptions:
    """The TextOptions of parsed `add_text_arguments` flags; `info` (a ModelInfo) caps --seq-len at its context."""
    seq_len = args.seq_len or DEFAULT_SEQ_LEN
    if info is not None:
        from ..hf.inputs import EvalSettings, fit_settings

        seq_len = fit_settings(info, EvalSettings(seq_len=seq_len)).seq_len
    texts = [args.text, args.eval_text]
    if args.chat_template:
        texts = [TextSource(tuple(source_items(t, split)), chat_template=True)
                 for t, split in zip(texts, ("calibration", "evaluation"))]
    calib = args.calib_samples * seq_len if args.calib_samples else (args.calib_tokens or 4096)
    return TextOptions(texts[0], texts[1], seq_len, calib, args.eval_tokens)


def text_files(texts: TextOptions) -> list[str]:
    """The files among a command's text sources (corpus names are not files): inputs no --out may replace."""
    import os

    items = []
    for source in (texts.text, texts.eval_text):
        if source is not None:
            items += [i for i in source_items(source, "evaluation") if os.path.exists(i)]
    return items


def format_default(value) -> str:
    """A default as a help text shows it: lists comma-separated, floats short, recipes by their text."""
    if isinstance(value, (list, tuple)):
        return ",".join(format_default(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


class StageBars:
    """Progress of `quantize --model` and `plan` on stderr: one rich bar per stage (capture, quantize layers, end to end,
    ablation) with the time left, fed by the library's `progress(message, done, total)` callbacks ('stage: detail').
    Started by the first report, so input errors, which come before any work, print as one clean line. When stderr
    is not a terminal (a log file, CI) a bar cannot redraw: each stage prints a line when it starts, at each
    quarter and when it ends, with the elapsed time and an estimate of what is left."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._bar = None
        self._tasks: dict[str, int] = {}
        self._lines = StageLines()  # without a terminal

    def __call__(self, message: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        stage, _, detail = message.partition(": ")
        if not sys.stderr.isatty():
            self._lines(message, done, total)
            return
        if self._bar is None:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self._bar = Progress(TextColumn("[bold]{task.fields[stage]}[/]"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn(),
                                 TextColumn("{task.description}"), console=Console(stderr=True))
            self._bar.start()
        if stage not in self._tasks:
            self._tasks[stage] = self._bar.add_task(detail, total=total, stage=stage)
        self._bar.update(self._tasks[stage], completed=done, total=total, description=detail)

    def __enter__(self) -> "StageBars":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close(ok=exc_type is None)

    def close(self, ok: bool = True) -> None:
        if self._bar is not None:
            if not ok:
                self._bar.live.transient = True  # after an error, its one line is all stderr shows
            self._bar.stop()
            self._bar = None


def add_target_argument(parser: Any) -> None:
    """--target-model: the model a draft model drafts for (`hf.draft`, `infra.target_model`)."""
    parser.add_argument("--target-model", metavar="PATH",
                        help="for a draft model (Gemma 4's assistants, whose forward reads the key/value states of "
                             "the model it drafts for): that target model's folder; each position of the text is "
                             "then run as the draft model's drafting step after it")


def add_device_argument(parser: Any, what: str = "the model") -> None:
    """--device: where the engine runs `what` (a decoder layer at a time; `infra.device`); and --target-model
    (`add_target_argument`) beside it wherever a command runs a model."""
    from ..infra.device import DEVICES

    add_target_argument(parser)

    parser.add_argument("--device", default="auto", metavar="|".join(DEVICES),
                        help=f"where {what} computes, a decoder layer at a time (cuda:N for one GPU of several); "
                             "auto: a CUDA GPU when torch sees one, else the CPU (default auto)")
