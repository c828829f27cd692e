"""`ffnquant plan`: a recipe per FFN layer of a causal LM that meets an end-to-end target at the least cost, verified."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..hf import EvalSettings, inspect_model
from ..hf.capture import read_text, require_transformers
from ..infra.atomic import write_json, write_text
from ..infra.atomic_folder import check_new_folder, folder_files, staged_folder
from ..infra.envinfo import environment
from ..infra.render import fmt
from ..planning.candidates import CANDIDATE_SETS
from ..planning.job import final_round
from ..planning.target import DECODE_TOKENS, OBJECTIVES, PLAN_RUNTIMES, TARGET_FORMS, Target
from ..recipe import GRAMMAR
from ..report.plan import domain_lines, plan_markdown
from ..wholemodel import plan_model, plan_request
from .bench import add_executor_arguments, executor_from_args
from .common import (StageBars, add_device_argument, add_memory_arguments, add_text_arguments, positive_int, text_files, text_options,
                     token_notes)

NAME = "plan"
HELP = "choose a recipe per FFN layer that meets an end-to-end target (ppl+1%, sqnr>=30) at the least latency or bytes, and verify it"

__all__ = ["NAME", "HELP", "PLAN_DOC", "add_arguments", "run"]

PLAN_DOC = "plan.json"  # the plan's document; its "files" are what --force may replace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="a local Hugging Face causal LM folder (safetensors)")
    parser.add_argument("--target", default="ppl+1%", help=f"what must hold end to end: {TARGET_FORMS.replace('%', '%%')} (default ppl+1%%)")
    parser.add_argument("--objective", default=None, choices=OBJECTIVES,
                        help="what to make least: FFN stack latency on --runtime, or weight bytes; "
                             "when not given, latency, or bytes for a model of routed experts (its layers are not one "
                             "FFN the latency table can time)")
    parser.add_argument("--runtime", default="ort-cpu", metavar="NAME[,NAME]",
                        help="where the latency objective times the candidates: ort-cpu (the ONNX artifacts on "
                             "onnxruntime's CPU provider), vllm-cpu (the model's FFNs in vLLM's CPU build, from a "
                             "compressed-tensors folder it loads; implies --serve vllm-cpu), genai-cpu (the model's FFNs in "
                             "onnxruntime-genai's generate loop on its ONNX decoder, profiled; implies --format onnx) "
                             "or a comma list of torch-module runtimes, each candidate "
                             "timed on the first with a kernel for it, e.g. triton-cuda,torch-cuda-graph for a GPU "
                             f"deployment; valid: {', '.join(PLAN_RUNTIMES)} (default ort-cpu)")
    parser.add_argument("--tokens", type=positive_int, default=512,
                        help="prompt tokens of the request the latency objective times: one prefill call (default 512)")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, metavar="N",
                        help="decode steps of that request, one token each with the KV cache: the objective is the FFN "
                             f"time of the prefill plus N steps, each measured (default {DECODE_TOKENS}; 0: prefill only)")
    parser.add_argument("--candidates", default="default",
                        help=f"candidate recipes: a set ({', '.join(CANDIDATE_SETS)}) or a comma-separated list of {GRAMMAR} "
                             "(default default)")
    parser.add_argument("--format", default=None, metavar="NAME",
                        help="the format the plan will be exported in (`export --format`): onnx or compressed-tensors; "
                             "candidates it cannot write for this model are left out, each listed in plan.md with "
                             "the format's reason, so the export of the plan is never refused (default: no format, "
                             "every candidate)")
    parser.add_argument("--serve", default=None, metavar="NAME",
                        help="where the plan's compressed-tensors folder will be served: vllm-cpu (vLLM's CPU build); "
                             "candidates that server does not run are left out, each listed in plan.md with its reason "
                             "(measured in vLLM: 8-bit weight-only, asymmetric 4-bit and static fp8 on its CPU build); "
                             "implies --format compressed-tensors (default: no server)")
    add_text_arguments(parser, "search (calibration) text", "held-out text the plan is verified on", eval_tokens=4096)
    parser.add_argument("--compute-dtype", default="auto", metavar="NAME",
                        help="what the deployed model computes in, which the verification rounds compute in: float32, "
                             "bfloat16 or float16; auto is the checkpoint's own dtype with --format compressed-tensors "
                             "(a bf16 checkpoint is served in bf16) and float32 otherwise (default auto)")
    parser.add_argument("--probe-tokens", type=positive_int, default=512,
                        help="search tokens the per-layer probes are measured on (default 512)")
    parser.add_argument("--rounds", type=positive_int, default=4, help="verification rounds at most (default 4)")
    parser.add_argument("--no-ort-floor", action="store_true",
                        help="keep static int8 candidates that score below onnxruntime's own best quantizer on a layer "
                             "(by default they are left out; measuring that floor takes a few seconds per layer)")
    add_executor_arguments(parser, "each layer's candidates sharing a preparation are one task, carrying the layer and "
                                   "its captured inputs; the plan is the same on every executor")
    add_memory_arguments(parser)
    add_device_argument(parser)
    parser.add_argument("--out", default="reports/plan",
                        help="a new (or empty) folder for plan.toml, plan.json, plan.md and atlas/ (default reports/plan)")
    parser.add_argument("--force", action="store_true",
                        help="replace --out if it holds an earlier plan (only the files its plan.json lists; any other "
                             "file there, such as your own notes, makes the plan refuse)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    parser.add_argument("--allow-pickle", action="store_true", help="allow a pickle checkpoint (loaded weights-only)")


def site_overlay(plan) -> dict[int, dict[str, str]]:
    """Per layer index, the recipe each site got: a `+float=SITE` recipe's float site reads 'float'."""
    from dataclasses import replace

    return {index: {site: "float" if recipe.is_float or recipe.keep_float == site else str(replace(recipe, keep_float=None))
                    for site in ("input", "hidden")} for index, recipe in plan.layers.items()}


def run(args: argparse.Namespace) -> int:
    # every input error before any work: target, objective, model, candidates, texts
    Target.parse(args.target)  # before the model is read: a bad target needs no model
    info = inspect_model(args.model, allow_pickle=args.allow_pickle)
    req = plan_request(info, args.target, args.objective, args.runtime, args.tokens, args.decode_tokens,
                       args.candidates, args.format, args.compute_dtype, args.serve)
    target, objective, left_out = req.target, req.objective, req.left_out
    require_transformers()
    texts = text_options(args, info)
    read_text(texts.text, "calibration")
    read_text(texts.eval_text, "evaluation")
    settings = EvalSettings(seq_len=texts.seq_len, max_calib_tokens=texts.calib_tokens,
                            max_eval_tokens=texts.eval_tokens, ablation=False)
    # as export's --out: a new or empty folder, or with --force one holding only what an earlier plan listed; never
    # the model's folder nor one holding a text it reads
    check_new_folder(args.out, args.force, inputs=[args.model, *text_files(texts)], listing=PLAN_DOC, make_parents=True)
    command = "ffnquant " + " ".join(shlex.quote(a) for a in getattr(args, "_argv", []))
    bars = StageBars(enabled=not args.no_progress)
    with executor_from_args(args) as executor, staged_folder(args.out, args.force, listing=PLAN_DOC,
                                                             make_parents=True) as out:
        try:
            outcome = plan_model(info, req, args.candidates, text=texts.text, eval_text=texts.eval_text,
                                 settings=settings, probe_tokens=args.probe_tokens, rounds=args.rounds,
                                 ort_floor=not args.no_ort_floor, allow_pickle=args.allow_pickle, progress=bars,
                                 executor=executor, max_memory=args.max_memory, sequential=args.sequential,
                                 on_memory=lambda memory: print(f"memory: {memory.summary()}"))
        except BaseException:
            bars.close(ok=False)
            raise
        bars.close()
        plan, result = outcome.plan, outcome.result
        result["command"] = command
        result["environment"] = environment()
        from ..report.atlas import write_atlas

        atlas = result.pop("atlas")
        write_atlas(atlas, out / "atlas", plan=site_overlay(plan),
                    meta={"model": str(args.model), "measured_on": "the search (calibration) text", "plan": "plan.toml"})
        result["atlas"] = "atlas/atlas.md"
        write_text(out / "plan.toml", plan.to_toml(command))
        write_text(out / "plan.md", plan_markdown(result, command))
        result["files"] = sorted({*folder_files(out), PLAN_DOC})  # what a later --force may replace
        write_json(out / PLAN_DOC, result)
    final_dir = Path(args.out)
    final = final_round(result)
    e = final["end_to_end"]
    unit = plan.summary["objective_unit"]
    cost = f"{final['cost']:.2f} ms" if unit == "ms" else f"{final['cost'] / 1e6:.2f} MB"
    fp32 = f"{result['fp32_cost']:.2f} ms" if unit == "ms" else f"{result['fp32_cost'] / 1e6:.2f} MB"
    recipes = {}
    for i, r in plan.layers.items():
        recipes.setdefault(str(r), []).append(i)
    print(f"plan for {target}: " + "; ".join(f"{r}: {len(v)} layer(s)" for r, v in recipes.items()))
    print(f"{'meets' if result['verified'] else 'MISSES'} {target} on every held-out text at its 95% confidence bound "
          f"after {len(result['rounds'])} round(s); final hidden SQNR {fmt(e.get('hidden_sqnr_db'))} dB on the worst:")
    for line in domain_lines(final, result["baseline"]):
        print(f"  {line}")
    for line in token_notes((result.get("token_budgets") or {}).values()):  # the terminal says it, not only plan.md
        print(line)
    print(f"FFN stack {objective.name}: {cost} (fp32 {fp32}); {fmt(result['timings']['total_s'])} s")
    folds = result.get("fold_refusals") or {}
    if folds:
        print(f"smoothing/AWQ not chosen on {len(folds)} layer(s) whose input scale cannot fold into a norm "
              f"(plan.md lists why), e.g. L{next(iter(folds))}: {next(iter(folds.values()))}")
    if left_out:
        what = f"--serve {req.serve}" if req.serve else f"--format {req.format}"
        print(f"left out for {what}: {', '.join(s['recipe'] for s in left_out)} (it cannot "
              f"{'run' if req.serve else 'write'} them here; plan.md says why)")
    for fmt_, why in (result.get("deployment") or {}).items():
        if why:
            print(f"note: export --format {fmt_} will refuse this model: {why}")
    target = f" --target-model {args.target_model}" if getattr(args, "target_model", None) else ""
    print(f"wrote {Path(final_dir) / 'plan.toml'} (use: ffnquant quantize --model {args.model}{target} --plan "
          f"{Path(final_dir) / 'plan.toml'}), plan.json, plan.md")
    for line in unresolved_lines(final, target):
        print(line)
    if not result["verified"]:
        print(f"note: the target was missed in {len(result['rounds'])} rounds; the plan file holds the last round's choice",
              file=sys.stderr)
        return 1
    return 0


def unresolved_lines(final: dict, target) -> list[str]:
    """'not verified: N tokens cannot resolve ppl+1%' for each held-out domain whose text is too small for the
    target's 95% interval to settle it, with about how many tokens would."""
    out = []
    for label, fig in (final.get("domains") or {}).items():
        res = fig.get("resolution") or {}
        if res.get("met") or res.get("resolved", True):
            continue
        need = res.get("tokens_needed")
        more = (f"; about {need:,} held-out tokens would (a longer --eval-text, more --eval-tokens)" if need
                else "; give a longer --eval-text")
        out.append(f"not verified: {fig.get('n_predicted') or 0:,} tokens of {label} cannot resolve {target}{more}")
    return out
