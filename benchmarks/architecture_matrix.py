#!/usr/bin/env python3
"""The architecture matrix: each causal-LM model type of the installed transformers, a tiny random-weight model
each (tests/hf_models.py), taken through every ffnquant command that reads a model, with the exit code and what
each command wrote or refused.

Per type (a draft model with a tiny model of its target's type, `--target-model`, `hf_models.DRAFT_TARGETS`): `model inspect`; `profile --model`; `quantize --model` (the model resident) and `quantize --model
--sequential` (read a decoder layer at a time, or the refusal); `model eval`; `plan` (ppl+5% over four
candidates); `export --format compressed-tensors` (proven, or the refusal) and `--format onnx` of that plan (the
whole-model graph, and whether it is a decoder with a KV cache whose greedy generation equals transformers').

Usage:
  PYTHONPATH=.:tests python benchmarks/architecture_matrix.py --out reports/architecture-matrix
Writes OUT/matrix.json and OUT/matrix.md (stamped with the machine, versions and the command).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128"]
# plan and export read whole windows of the held-out text: 128 tokens (a model without a context length, ALiBi's
# BLOOM and MPT, would take 512-token windows, more than the 128 held-out tokens)
WINDOW = ["--seq-len", "128"]
CANDIDATES = "fp32,w8a8@search+smooth,w8a8-dynamic-s8,w4a16-g32"


def _first_line(exc: BaseException) -> str:
    """The exception's first line that says something (transformers' ImportError starts with an empty one)."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


def _run(argv: list[str]) -> tuple[int, str]:
    """`ffnquant ARGV` in this process: (exit code, when it failed the last line of stderr, else of stdout: an
    export NOT PROVEN says why on stdout)."""
    from ffnquant.cli import main

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            rc = main(argv)
        except SystemExit as exc:
            rc = int(exc.code or 0)
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()] or \
        [ln for ln in out.getvalue().splitlines() if ln.strip()]
    return rc, (lines[-1] if rc and lines else "")


def _why(message: str, folder: Path) -> str:
    """The refusal, its temporary folder named as the model type."""
    return message.split("error: ", 1)[-1].replace(str(folder), folder.name)[:220]


def _routed(folder: Path) -> bool:
    from ffnquant.hf import inspect_model

    try:
        return any(layer.expert is not None for layer in inspect_model(folder).layers)
    except Exception:  # noqa: BLE001 - the inspect cell says why
        return False


def one_type(model_type: str, folder: Path, work: Path, target: Path | None = None) -> dict:
    """Every command on one model folder: {command: {"rc", "result"}}. `target`: a draft model's target model's
    folder, given to every command that runs the model (`--target-model`)."""
    row: dict[str, dict] = {}
    t0 = time.perf_counter()

    def cell(name: str, argv: list[str], result=None) -> int:
        if target is not None and name != "inspect":
            argv = [*argv, "--target-model", str(target)]
        rc, err = _run(argv)
        if rc == 0 and result is not None:
            try:
                text = result()
            except Exception as exc:  # noqa: BLE001 - a figure the matrix reads that this command did not write
                text = f"(its report has no {exc!r})"
        row[name] = {"rc": rc, "result": (text if result else "") if rc == 0 else _why(err, folder)}
        return rc

    cell("inspect", ["model", "inspect", str(folder)])
    cell("profile", ["profile", "--model", str(folder), "--model-tokens", "256", "--variants", "swiglu",
                     "--tokens", "256", "--no-positions", "--out", str(work / "profile")])

    def quantized(out: Path):
        doc = json.loads(next(out.glob("*.json")).read_text())
        e = doc["end_to_end"]["end_to_end"]
        return f"ppl x{e['perplexity_ratio']:.4f}, final hidden SQNR {e['hidden_sqnr_db']:.1f} dB"

    for mode, flag in (("quantize", []), ("quantize --sequential", ["--sequential"])):
        out = work / mode.replace(" ", "_")
        cell(mode, ["quantize", "--model", str(folder), "--scheme", "w8a8", *TOKENS, "--no-onnx", "--no-progress",
                    *flag, "--out-reports", str(out)], lambda out=out: quantized(out))
    cell("model eval", ["model", "eval", str(folder), "--schemes", "w8a8,w4a16-g32", "--max-calib-tokens", "256",
                        "--max-eval-tokens", "128", "--out", str(work / "eval")])
    plan = work / "plan"

    def planned():
        data = json.loads((plan / "plan.json").read_text())
        chosen = sorted({row["recipe"] for row in data["plan"]["layers"]})
        return f"{'verified' if data['verified'] else 'NOT verified'}: {', '.join(chosen)}"

    # routed experts: planned for the one format that stores them, which gives all of them one recipe (`deploy.experts`)
    fmt = ["--format", "compressed-tensors"] if row["inspect"]["rc"] == 0 and _routed(folder) else []
    rc = cell("plan", ["plan", "--model", str(folder), "--target", "ppl+5%", "--candidates", CANDIDATES, "--objective",
                       "bytes", *fmt, *TOKENS, *WINDOW, "--probe-tokens", "128", "--no-progress", "--out", str(plan)],
              planned)
    for fmt in ("compressed-tensors", "onnx"):
        out = work / f"export-{fmt}"

        def exported(out=out, fmt=fmt):
            doc = json.loads((out / "ffnquant-deploy.json").read_text())
            if fmt == "compressed-tensors":
                return "proven" if doc["proof"]["proven"] else "NOT proven"
            graph = doc.get("graph") or {}
            reason = str(graph.get("reason") or "").replace(str(folder), folder.name)
            text = f"graph {graph.get('status')}" + (f" ({reason})" if reason else "")
            decoder = graph.get("decoder") or {}
            if decoder.get("status") == "ok":
                gen = decoder.get("generation") or {}
                text += (f"; decoder with KV cache ({decoder.get('attention')}), greedy generation "
                         f"{'equals' if gen.get('equal') else 'DIFFERS from'} transformers' on {gen.get('prompts')} "
                         f"prompts x {gen.get('new_tokens')} tokens")
            elif decoder:
                text += f"; prefill graph only: {str(decoder.get('reason', ''))[:120]}"
            return text

        if rc != 0:
            row[f"export {fmt}"] = {"rc": None, "result": "no plan"}
            continue
        cell(f"export {fmt}", ["export", "--model", str(folder), "--plan", str(plan / "plan.toml"), "--format", fmt,
                               *TOKENS, *WINDOW, "--no-progress", "--out", str(out)], exported)
    row["seconds"] = time.perf_counter() - t0
    return row


COMMANDS = ("inspect", "profile", "quantize", "quantize --sequential", "model eval", "plan", "export compressed-tensors",
            "export onnx")


def verdict(row: dict) -> str:
    """One word for a type's row: what a user gets end to end."""
    if "build" in row:  # the child process ended without a row: a timeout, or the tiny model not built
        return "did not finish in the time allowed" if "did not finish" in row["build"] else "tiny model does not build"
    if any((row.get(c) or {}).get("rc") == 3 for c in COMMANDS):
        return "internal error"
    if row["inspect"]["rc"] != 0:
        return "refused whole"
    ct = row.get("export compressed-tensors") or {}
    if ct.get("rc") == 0 and ct.get("result") == "proven":
        return "exported and proven"
    if ct.get("rc") == 1:
        return "NOT PROVEN"
    if row["plan"]["rc"] != 0:
        return "plans no"
    return "one feature refused"


def _markdown(res: dict) -> str:
    from ffnquant.infra.render import markdown_table

    lines = ["# Architecture matrix: every ffnquant command on each causal-LM type", "",
             f"Command: `{res['command']}`", "",
             "A tiny random-weight model of each type (2 decoder layers, d_model 32; `tests/hf_models.py`), built by "
             f"the installed transformers ({res['transformers']}). A cell is `ok` with what the command measured or "
             "wrote, or the command's one-line refusal (exit 2). Random weights: the figures show that each command "
             "runs and what it measures, not what a trained model of the type would give. Models of routed experts "
             "are planned with `--format compressed-tensors` (one recipe for all their experts).", ""]
    counts: dict[str, list[str]] = {}
    for model_type, row in res["types"].items():
        counts.setdefault(verdict(row), []).append(model_type)
    lines += ["## Summary", "", markdown_table(["verdict", "types", "which"],
                                               [[v, len(t), ", ".join(t)] for v, t in sorted(counts.items())]), ""]
    rows = []
    for model_type, row in res["types"].items():
        if "build" in row:
            rows.append([model_type, f"{verdict(row)}: {row['build']}", *[""] * (len(COMMANDS) - 1),
                         f"{row['seconds']:.0f} s"])
            continue
        cells = []
        for c in COMMANDS:
            r = row.get(c) or {"rc": None, "result": "not run"}
            if r["rc"] == 0:
                cells.append("ok" + (f": {r['result']}" if r["result"] else ""))
            elif r["rc"] is None:
                cells.append(r["result"])
            else:
                cells.append(f"refused (exit {r['rc']}): {r['result']}")
        shown = f"{model_type} (through a {row['target']} target)" if row.get("target") else model_type
        rows.append([shown, *cells, f"{row['seconds']:.0f} s"])
    lines += ["## Every type", "", markdown_table(["type", *COMMANDS, "time"], rows), ""]
    env = res["environment"]
    lines += ["## Environment", "", "```", json.dumps(env, indent=1, default=str)[:3000], "```", ""]
    return "\n".join(lines)


def _one(model_type: str, out: Path) -> int:
    """One type in this process (what `main` runs in a child per type): its row as JSON at `out`."""
    import transformers as T

    from ffnquant.infra.atomic import write_json
    from hf_models import DRAFT_TARGETS, save_causal_tiny, tokenizer

    T.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        target = None
        try:
            folder = save_causal_tiny(T, model_type, Path(tmp) / model_type, tokenizer(T))
            if model_type in DRAFT_TARGETS:  # a draft model runs through the tiny model of its target's type
                target = save_causal_tiny(T, DRAFT_TARGETS[model_type], Path(tmp) / "target", tokenizer(T))
        except Exception as exc:  # noqa: BLE001 - transformers' own failure to build its tiny config, said
            row = {"build": f"{type(exc).__name__}: {_first_line(exc)}"[:220],
                   "seconds": time.perf_counter() - t0}
        else:
            row = one_type(model_type, folder, Path(tmp) / f"{model_type}-work", target)
            if target is not None:
                row["target"] = DRAFT_TARGETS[model_type]
    write_json(out, row)
    return 0


def all_types() -> list[str]:
    """Every model type transformers maps to a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def main(argv: list[str] | None = None) -> int:
    import subprocess

    import transformers as T

    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment
    from hf_models import CAUSAL_TYPES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/architecture-matrix")
    ap.add_argument("--types", default=",".join(CAUSAL_TYPES),
                    help="comma list of model types, or 'all': every causal-LM type of the installed transformers")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per type (default 900)")
    ap.add_argument("--jobs", type=int, default=1, help="types run side by side, each on cores / jobs threads")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: one type, in a child process
    ap.add_argument("--row", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        return _one(args.one, Path(args.row))
    res = {"command": "PYTHONPATH=.:tests python benchmarks/architecture_matrix.py "
                      + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
           "transformers": T.__version__, "types": {}}
    types = all_types() if args.types == "all" else args.types.split(",")
    out = Path(args.out)
    import os
    from concurrent.futures import ThreadPoolExecutor

    threads = str(max(1, (os.cpu_count() or 1) // max(1, args.jobs)))
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
    done = [0]

    def one(model_type: str, tmp: str) -> tuple[str, dict]:
        row_path = Path(tmp) / f"{model_type}.json"
        t0 = time.perf_counter()
        # each type in its own process: a type that hangs or exhausts memory costs its row, not the matrix
        try:
            proc = subprocess.run([sys.executable, __file__, "--one", model_type, "--row", str(row_path)],
                                  capture_output=True, text=True, timeout=args.timeout, env=env)
            failed = None if row_path.exists() else (proc.stderr.strip().splitlines() or ["no output"])[-1]
        except subprocess.TimeoutExpired:
            failed = f"did not finish in {args.timeout:.0f} s"
        row = json.loads(row_path.read_text()) if failed is None else {
            "build": f"the matrix's child process failed: {failed}"[:220], "seconds": time.perf_counter() - t0}
        done[0] += 1
        print(f"[{done[0]}/{len(types)}] {model_type}: {verdict(row)} ({row['seconds']:.0f} s)", flush=True)
        return model_type, row

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(max(1, args.jobs)) as pool:
        rows = dict(pool.map(lambda t: one(t, tmp), types))
    res["types"] = {t: rows[t] for t in types}
    res["environment"] = environment()
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "matrix.json", res)
    write_text(out / "matrix.md", _markdown(res))
    print(f"wrote {out / 'matrix.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
