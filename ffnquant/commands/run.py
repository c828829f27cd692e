"""`ffnquant run`: the main job, end to end, with a progress bar; prints the recommendations and report paths."""

from __future__ import annotations

import argparse
import os
import shlex
import sys

from ..errors import FFNQuantError
from ..infra.render import display_path, text_table
from ..pipeline import RunConfig, load_config
from ..recipe import GRAMMAR
from .common import add_model_arguments, add_spec_arguments, add_target_argument, format_default, positive_int

NAME = "run"
HELP = "profile, quantize, export and benchmark every FFN variant, and write the accuracy/latency report"

# Options that map one to one onto RunConfig fields (dest -> field); None means "not given".
_FIELDS = {
    "variants": "variants", "d_model": "d_model", "d_ff": "d_ff", "multiple_of": "multiple_of",
    "ffn_dim_multiplier": "ffn_dim_multiplier", "bias": "bias", "seed": "seed", "source": "source",
    "outlier_channels": "n_outlier_channels", "outlier_scale": "outlier_scale", "calib_tokens": "calib_tokens",
    "eval_tokens": "eval_tokens", "batch_size": "batch_size", "bins": "bins", "schemes": "schemes",
    "baseline": "baseline", "target_db": "target_db", "sensitivity": "sensitivity", "onnx": "onnx", "runtimes": "runtimes",
    "tokens": "tokens", "budget_s": "budget_s", "out": "out_reports", "export": "out_export",
    "model": "model", "layers": "layers", "text": "text", "eval_text": "eval_text", "plan": "plan",
}


def _default(field: str) -> str:
    """RunConfig's default of `field` as the help shows it: the help can never disagree with the code."""
    return format_default(RunConfig.__dataclass_fields__[field].default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    # Defaults come from RunConfig (or --config / --tiny): an option left out must not override them.
    parser.set_defaults(variants=None, d_model=None, seed=None)
    parser.add_argument("--config", metavar="FILE.toml", help="read the run configuration from a TOML file "
                        "(options given on the command line override it); every run writes its own as run.toml")
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (d_model 64, 3 variants, few tokens)")
    parser.add_argument("--source", help=f"data: gaussian, llm_like, file:PATH or PATH.npy/.safetensors [tokens, d_model] (default {_default('source')})")
    parser.add_argument("--outlier-channels", type=int, help=f"llm_like: number of outlier input channels (default {_default('n_outlier_channels')})")
    parser.add_argument("--outlier-scale", type=float, help=f"llm_like: their magnitude (default {_default('outlier_scale')})")
    parser.add_argument("--calib-tokens", type=positive_int, help=f"calibration tokens (default {_default('calib_tokens')})")
    parser.add_argument("--eval-tokens", type=positive_int, help=f"held-out evaluation tokens (default {_default('eval_tokens')})")
    parser.add_argument("--batch-size", type=positive_int, help=f"profiling batch size (default {_default('batch_size')})")
    parser.add_argument("--bins", type=positive_int, help=f"histogram bins per site (default {_default('bins')})")
    parser.add_argument("--schemes", help=f"comma-separated {GRAMMAR} "
                        f"(default {_default('schemes')})")
    parser.add_argument("--baseline", help=f"the float scheme speedups are measured against (default {_default('baseline')})")
    parser.add_argument("--target-db", type=float, help=f"accuracy target: SQNR in dB a recommendation must meet (default {_default('target_db')})")
    parser.add_argument("--no-sensitivity", dest="sensitivity", action="store_false", default=None,
                        help="skip the per-site sensitivity of the worst cases")
    parser.add_argument("--no-onnx", dest="onnx", action="store_false", default=None,
                        help="skip the ONNX export and artifacts (torch reference accuracy only)")
    parser.add_argument("--runtimes", help="comma-separated runtimes, 'available' (every runtime available here, the default) "
                        "or 'none' (accuracy only, no latency)")
    parser.add_argument("--tokens", help=f"token counts M to time, comma-separated (default {_default('tokens')})")
    parser.add_argument("--budget-s", type=float, help=f"time budget per latency case in seconds (default {_default('budget_s')})")
    parser.add_argument("--out", help=f"report folder (default {_default('out_reports')})")
    parser.add_argument("--export", help=f"artifact folder (default {_default('out_export')})")
    # --model: the folder's FFN layers run as extra rows next to the variants (keyed '<model_type>:L<k>')
    add_model_arguments(parser, captured=False, model_tokens=False, eval_text=True, allow_pickle=False,
                        layers_default=None)
    add_target_argument(parser)
    parser.add_argument("--plan", metavar="FILE", help="--model: also measure this `ffnquant plan` file (a recipe per "
                                                       "layer) end to end beside the single recipes")


def config_from_args(args: argparse.Namespace):
    """The RunConfig the arguments describe: --config file or --tiny preset or defaults, then the options given."""
    if args.config and args.tiny:
        raise FFNQuantError("--config and --tiny are exclusive")
    base = load_config(args.config) if args.config else (RunConfig.tiny() if args.tiny else RunConfig())
    changes = {}
    for dest, field in _FIELDS.items():
        value = getattr(args, dest, None)
        if value is not None:
            changes[field] = value
    if changes.get("variants") == "all":
        changes["variants"] = ()
    return base.with_(**changes) if changes else base


class _ProgressBar:
    """A rich progress bar on stderr, started by the first report from `run` (so that input errors,
    which come before any work, print as one clean line)."""

    def __init__(self) -> None:
        self._bar = None
        self._task = None

    def __call__(self, message: str, done: int, total: int) -> None:
        if self._bar is None:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("[bold]ffnquant run[/]"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.description}"), console=Console(stderr=True))
            self._task = self._bar.add_task("", total=total)
            self._bar.start()
        self._bar.update(self._task, completed=done, total=total, description=message)

    def close(self, ok: bool = True) -> None:
        if self._bar is not None:
            if not ok:
                self._bar.live.transient = True  # after an error, its one line is all stderr shows
            self._bar.stop()


def run(args: argparse.Namespace) -> int:
    from ..pipeline import run as run_job

    config = config_from_args(args)  # every bad option fails here, before anything is written
    argv = getattr(args, "_argv", None) or ["run"]
    # paths outside the working folder are shown as folder/name: reports never print this machine's layout
    command = "ffnquant " + " ".join(shlex.quote(display_path(a) if os.path.isabs(a) else a) for a in argv)
    bar = _ProgressBar()
    try:
        result = run_job(config, progress=bar, command=command)
    except BaseException:
        bar.close(ok=False)
        raise
    bar.close()
    for line in recommendation_lines(result.recommendations, config, result.document["timing"]["latency"]):
        print(line)
    for m in result.document["missing"]:
        print(f"not in this report: {m['part']}: {m['reason']}", file=sys.stderr)
    model = result.document.get("model") or {}
    for split in ("calibration", "evaluation"):
        budget = (model.get(split) or {}).get("tokens") or {}
        if budget.get("short"):
            print(f"note: {budget['note']}", file=sys.stderr)
    for f in result.document["findings"]:
        print(f"- {f['text']}")
    print(f"wall time {result.document['timing']['wall_s']:.1f} s")
    for kind in ("json", "md", "html", "config"):
        print(f"{kind}: {result.paths[kind]}")
    return 0


def _unrecommended(rec: dict) -> bool:
    """A recommendation that recommends nothing: no trusted timing, or the baseline kept for suspect timings."""
    return rec.get("choice") is None or "(timing suspect)" in (rec.get("label") or "")


def recommendation_lines(recs: list[dict], config: RunConfig, latency: dict) -> list[str]:
    """The terminal's recommendations: one column per token count M (variant x runtime rows), then, for every
    M where some pair has no recommendation, one line saying why; the reasons behind the largest M's choices."""
    tokens = list(config.tokens)
    if latency.get("status") == "missing" or not recs:
        return [f"No recommendation at any M: {latency.get('reason') or 'no latency case was timed'}"]
    order = {v: i for i, v in enumerate(config.variants)}
    by_key = {(r["variant"], r["runtime"], r["tokens"]): r for r in recs}
    pairs = sorted({(r["variant"], r["runtime"]) for r in recs}, key=lambda k: (order.get(k[0], len(order)), k[1]))
    lines = [f"Recommendations per token count M (SQNR target {config.target_db:g} dB, speedup against "
             f"{config.baseline} on the same runtime):",
             text_table(["variant", "runtime"] + [f"M={m}" for m in tokens],
                        [(v, rt) + tuple((by_key.get((v, rt, m)) or {}).get("label") or "-" for m in tokens)
                         for v, rt in pairs])]
    for m in tokens:
        at = [by_key[(v, rt, m)] for v, rt in pairs if (v, rt, m) in by_key]
        bad = [r for r in at if _unrecommended(r)]
        if not at:
            lines.append(f"M={m}: no recommendation: no case was timed at this token count")
        elif bad:
            lines.append(f"M={m}: no recommendation for {len(bad)} of {len(at)} variant/runtime pairs: "
                         f"{bad[0]['variant']} on {bad[0]['runtime']}: {bad[0]['reason']}")
    primary = max(tokens)
    why = [by_key[(v, rt, primary)] for v, rt in pairs if (v, rt, primary) in by_key]
    if why:
        lines.append(f"Why, at M={primary}:")
        lines += [f"- {r['variant']} on {r['runtime']}: {r['reason']}" for r in why]
    return lines
