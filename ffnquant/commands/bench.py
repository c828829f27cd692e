"""`ffnquant bench`: latency of FFN variants per runtime, format and token count -> latency.json + latency.md."""

from __future__ import annotations

import argparse
import math
import re
import shlex

from ..bench import BenchConfig, run_benchmark
from ..errors import FFNQuantError
from ..infra.atomic import OutputTransaction, write_json, write_text
from ..infra.render import display_path
from ..measure.executor import EXECUTORS, get_executor
from ..recipe import Recipe
from ..runtimes import ModelCase, get_runtime, parse_formats, runtime_names
from .common import add_spec_arguments, specs_from_args

NAME = "bench"
HELP = "measure FFN latency per runtime, scheme and token count (decode and prefill); writes latency.json/.md"


def _float_positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):  # inf would also reach the report, which JSON cannot hold
        raise argparse.ArgumentTypeError(f"expected a positive finite number of seconds, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser, default_variants="relu,swiglu")
    parser.add_argument("--runtimes", default="available",
                        help="comma-separated runtimes or 'available' (every runtime that really runs here)")
    parser.add_argument("--schemes", default="all",
                        help="comma-separated schemes or 'all' (each runtime's supported formats)")
    parser.add_argument("--tokens", default="1,16,512,2048", help="tokens per call, comma-separated (default 1,16,512,2048)")
    parser.add_argument("--budget-s", type=_float_positive, default=0.5, help="timed seconds per case (default 0.5)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up calls per case (default 3)")
    parser.add_argument("--min-repeats", type=int, default=5, help="timed calls at least, even past the budget (default 5)")
    parser.add_argument("--skip-unavailable", action="store_true",
                        help="record named runtimes that are not available (with the reason) instead of failing")
    parser.add_argument("--max-total-s", type=_float_positive, default=None,
                        help="stop starting new models after this many seconds; the rest is listed as not run")
    parser.add_argument("--measure-bandwidth", action="store_true",
                        help="measure the device copy bandwidth for the roofline where no peak is tabled (e.g. CPU)")
    add_executor_arguments(parser, "each (runtime, scheme, shape) case with its token counts is one task; a case on a "
                                   "Ray worker is timed on that worker's machine, and the report names its host")
    parser.add_argument("--out", default="reports", help="output folder (default reports/)")
    parser.add_argument("--name", default="latency",
                        help="file stem of the outputs: letters, digits, '.', '_', '-', not starting with '.' (default latency)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def add_executor_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """--executor and --ray-address (bench and plan)."""
    parser.add_argument("--executor", default="local", choices=tuple(EXECUTORS),
                        help="where the tasks run (default local): " + "; ".join(f"{k}, {v}" for k, v in EXECUTORS.items())
                        + f"; {what}")
    parser.add_argument("--ray-address", default=None, metavar="ADDRESS",
                        help="the Ray cluster to run on with --executor ray (default: $RAY_ADDRESS, else a local Ray instance)")


def executor_from_args(args: argparse.Namespace):
    """The executor the arguments name, started (a Ray cluster reached) before any work."""
    return get_executor(args.executor, args.ray_address)


def _parse_tokens(text: str) -> tuple[int, ...]:
    try:
        tokens = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise FFNQuantError(f"--tokens must be comma-separated positive integers, got {text!r}") from None
    if not tokens or any(t <= 0 for t in tokens):
        raise FFNQuantError(f"--tokens must be comma-separated positive integers, got {text!r}")
    return tokens


# A plain file name in --out: no folders (no '/', no '..'), no hidden or temporary-looking names.
_STEM_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def check_file_stem(value: str, option: str = "--name") -> str:
    """`value` if it is a plain file stem, else a one-line FFNQuantError saying what is valid."""
    if not isinstance(value, str) or not _STEM_RE.fullmatch(value):
        raise FFNQuantError(f"{option} {value!r} is not a plain file stem; valid: 1-128 letters, digits, '.', '_' "
                            "and '-', not starting with '.' (e.g. latency)")
    return value


def plan_from_args(args: argparse.Namespace):
    """Validate everything before measuring: (specs, runtime adapters, schemes or None, config)."""
    check_file_stem(args.name)  # the outputs go to --out/<name>.json and .md, never elsewhere
    specs = specs_from_args(args)
    tokens = _parse_tokens(args.tokens)
    config = BenchConfig(tokens=tokens, budget_s=args.budget_s, warmup=args.warmup, min_repeats=args.min_repeats,
                         seed=args.seed, measure_bandwidth=args.measure_bandwidth, max_total_s=args.max_total_s)
    names = [n.strip().lower() for n in args.runtimes.split(",") if n.strip()]
    if names == ["available"]:
        adapters = [get_runtime(n) for n in runtime_names()]
        adapters = [rt for rt in adapters if rt.availability().available]
    else:
        adapters = [get_runtime(n) for n in dict.fromkeys(names)]  # unknown names raise here
        for rt in adapters:
            avail = rt.availability()
            if not avail.available and not args.skip_unavailable:
                raise FFNQuantError(f"runtime {rt.name} is not available: {avail.reason}")
    if not adapters:
        raise FFNQuantError("no runtime given")
    usable = [rt for rt in adapters if rt.availability().available]
    schemes = None if args.schemes.strip().lower() == "all" else parse_formats(_preset_names(args.schemes))
    for scheme in schemes or []:
        # With --skip-unavailable a scheme only the missing runtimes support is listed as not run.
        if not args.skip_unavailable and not any(scheme in rt.formats for rt in usable):
            raise FFNQuantError(
                f"scheme {scheme!r} is not supported by {', '.join(rt.name for rt in usable)}; "
                + "; ".join(f"{rt.name} supports {', '.join(rt.formats)}" for rt in usable)
            )
    # Sizes each kernel cannot take (e.g. 4-bit groups not dividing d_ff) fail here, not mid-sweep.
    for spec in specs:
        for rt in usable:
            for scheme in schemes or ():  # with 'all', formats a size does not fit are skipped, not errors
                if scheme in rt.formats:
                    rt.check(ModelCase(spec, scheme, seed=args.seed, max_tokens=max(tokens)))
    return specs, adapters, schemes, config


def _command_line(args: argparse.Namespace) -> str:
    """The equivalent command line, rebuilt from the parsed arguments (for the report header)."""
    parts = ["ffnquant", "bench", "--variants", args.variants, "--d-model", str(args.d_model)]
    for flag, value in (("--d-ff", args.d_ff), ("--multiple-of", args.multiple_of),
                        ("--ffn-dim-multiplier", args.ffn_dim_multiplier)):
        if value is not None:
            parts += [flag, str(value)]
    if args.bias is not None:
        parts.append("--bias" if args.bias else "--no-bias")
    parts += ["--seed", str(args.seed), "--runtimes", args.runtimes, "--schemes", args.schemes, "--tokens", args.tokens,
              "--budget-s", str(args.budget_s), "--warmup", str(args.warmup), "--min-repeats", str(args.min_repeats)]
    if args.measure_bandwidth:
        parts.append("--measure-bandwidth")
    if args.skip_unavailable:
        parts.append("--skip-unavailable")
    if args.max_total_s is not None:
        parts += ["--max-total-s", str(args.max_total_s)]
    if args.executor != "local":
        parts += ["--executor", args.executor] + (["--ray-address", args.ray_address] if args.ray_address else [])

    parts += ["--out", display_path(args.out), "--name", args.name]  # never this machine's absolute layout
    return " ".join(shlex.quote(p) for p in parts)


def _preset_names(text: str) -> list[str]:
    """The schemes of --schemes read in the one recipe grammar; bench times each preset's own kernels, so a
    recipe with a calibrator or remedies is refused with where it can be timed (on its own artifact)."""
    names = []
    for item in (t for t in text.split(",") if t.strip()):
        recipe = Recipe.parse(item)
        if recipe.calibrator or recipe.has_remedies:
            raise FFNQuantError(f"bench times scheme presets (e.g. {recipe.scheme}); {recipe.name!r} carries a calibrator "
                                f"or remedies: time it on its own artifact with: ffnquant run --schemes fp32,{recipe.name}")
        names.append(recipe.scheme)
    return names


def run(args: argparse.Namespace) -> int:
    specs, adapters, schemes, config = plan_from_args(args)
    # Both files are staged in --out and moved into place together at the end: a failure or Ctrl-C
    # mid-sweep leaves --out as it was.
    with executor_from_args(args) as executor, OutputTransaction() as tx:
        json_path, md_path, result = _measure_and_write(args, tx.folder(args.out), specs, adapters, schemes, config,
                                                        executor)
        json_path, md_path = tx.final(json_path), tx.final(md_path)
    ok = sum(1 for c in result.cases if c.ok)
    failed = len(result.cases) - ok
    slower = sum(1 for c in result.cases if c.slower_than_baseline)
    hosts = sorted({c.host for c in result.cases if c.host})
    where = f" on {len(hosts)} hosts ({', '.join(hosts)})" if len(hosts) > 1 else ""
    print(f"{ok} cases measured{where}, {failed} failed, {slower} slower than their float baseline; "
          f"wrote {json_path} and {md_path}")
    return 0


def _measure_and_write(args: argparse.Namespace, out, specs, adapters, schemes, config, executor=None):
    """Run the sweep and write <name>.json and <name>.md into `out`; returns (json path, md path, result)."""
    from ..report.latency import latency_markdown

    command = _command_line(args)
    if args.no_progress:
        result = run_benchmark(specs, adapters, schemes, config, executor=executor)
    else:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      transient=True) as bar:
            task = bar.add_task("bench", total=None)

            def progress(done: int, total: int, label: str) -> None:
                bar.update(task, completed=done, total=total, description=label)

            result = run_benchmark(specs, adapters, schemes, config, progress=progress, executor=executor)
    result.command = command
    doc = result.to_dict()
    json_path = write_json(out / f"{args.name}.json", doc)
    md_path = write_text(out / f"{args.name}.md", latency_markdown(doc))
    return json_path, md_path, result
