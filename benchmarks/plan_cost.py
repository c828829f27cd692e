#!/usr/bin/env python3
"""What a verified plan costs against the peer's oneshot, in one run on one machine.

Times, one after the other on the same machine (each step a subprocess, wall clock):
  1. `ffnquant plan --model M --target ppl+1%` with every other option at its default (--plan-args adds some);
  2. `ffnquant export` of that plan (its proof included);
  3. `ffnquant.apply(M, RECIPE)` + `ffnquant.save(...)` of one recipe (default w8a8-dynamic-s8);
  4. llm-compressor's W8A8 `oneshot` (SmoothQuant + GPTQ on the FFN Linears, --peer-samples x 512 tokens;
     benchmarks/peer_llmcompressor.py, run by the interpreter of an environment that has llm-compressor).
and writes OUT/plan_cost.json and OUT/plan_cost.md: each step's time, the ratios to the peer, the plan's time per
stage (from its plan.json), its verified figures on each held-out domain and the export's proof. `--before FILE`
adds an earlier run's plan_cost.json (e.g. of an older checkout, `--source DIR`) as the "before" columns.

Usage:
  python3 benchmarks/plan_cost.py --model models/smollm2-135m-instruct --peer-python peer-venv/bin/python \
      --out reports/plan-cost/smollm2-135m
  # the same steps run by another checkout of ffnquant (PYTHONPATH=DIR), e.g. the one before a change:
  python3 benchmarks/plan_cost.py --model ... --source /tmp/ffnquant-before --skip-peer --out /tmp/before
  # on a GPU: the default plan of a random-weight bf16 model at Llama-3-8B's shapes built at run time, stopped at
  # a limit (scripts/gpu_session.sh's plan_8b stage):
  python3 benchmarks/plan_cost.py --random-model llama3-8b --skip-peer --skip-apply --skip-export --progress \
      --step-limit-s 600 --plan-args "--device cuda --runtime triton-cuda,torch-cuda-graph" --out OUT/plan-8b
Exit 0 when every step ran (a step that failed is reported, with its last lines, and exits 1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

APPLY_SAVE = """
import sys, time, ffnquant
model, recipe, out = sys.argv[1:4]
t = time.perf_counter()
q = ffnquant.apply(model, recipe)
t_apply = time.perf_counter() - t
report = ffnquant.save(q, out)
print("APPLY_SAVE", t_apply, time.perf_counter() - t, "proven" if report.proven else f"NOT proven ({report.proven})",
      flush=True)
"""

# the plan's stages, in the order they run (plan.json's `timings`), with what each is
STAGES = (
    ("capture_s", "float reference and captures (texts through every layer, the head's figures)"),
    ("gradients_s", "loss gradients (one backward pass, layer by layer)"),
    ("latency_table_s", "latency table (candidates timed at the model's shape)"),
    ("candidates_s", "candidate scoring and probe ablations"),
    ("ort_floor_s", "onnxruntime's floor (layers where a static int8 candidate was picked)"),
    ("deferred_candidates_s", "deferred candidates (GPTQ, AWQ) scored on the layers where a solution picked one"),
    ("verify_s", "verification rounds"),
    ("low_precision_baseline_s", "the float model in the compute dtype (bf16 plans)"),
    ("atlas_s", "range atlas"),
    ("total_s", "total (make_plan)"),
)


# runs `python -m MODULE ARGS...` with a daemon thread writing every other thread's Python stack to a file every S
# seconds (sys._current_frames holds the GIL; faulthandler's watchdog reads frames without it and can crash the run)
_SAMPLED = """
import runpy, sys, threading, time, traceback
out, every = open(sys.argv[1], "w"), float(sys.argv[2])
sys.argv = sys.argv[3:]
def sample():
    t0 = time.monotonic()
    while True:
        time.sleep(every)
        me = threading.get_ident()
        stacks = [f"thread {i}:\\n" + "".join(traceback.format_stack(f))
                  for i, f in sys._current_frames().items() if i != me]
        out.write(f"--- {time.monotonic() - t0:.0f} s\\n" + "".join(stacks))
        out.flush()
threading.Thread(target=sample, daemon=True).start()
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""


def sampled(cmd: list[str], every_s: float, path: Path) -> list[str]:
    """`cmd` ([python, -m, module, args...]) with its Python stacks written to `path` every `every_s` seconds."""
    if cmd[1:2] != ["-m"]:
        raise ValueError(f"not a `python -m` command: {cmd[:3]}")
    return [cmd[0], "-c", _SAMPLED, str(path), str(every_s), *cmd[2:]]


def run_step(name: str, cmd: list[str], env: dict[str, str], log: Path, limit_s: float | None = None,
             gpu_memory: bool = False, shown: str | None = None) -> dict:
    """Run one step, its output to `log` with each line's elapsed seconds; {command, seconds, rc, tail}. Past
    `limit_s` the step gets SIGTERM (ffnquant leaves its output folders as they were) and rc 124; with `gpu_memory`
    the GPU's used memory is sampled each second (nvidia-smi) and its peak recorded."""
    t = time.perf_counter()
    peak = {"mib": None}
    stop = threading.Event()

    def sample() -> None:  # the device's used memory, all processes: the step is the only one on it
        while not stop.wait(1.0):
            q = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
            if q.returncode == 0 and q.stdout.strip():
                peak["mib"] = max(peak["mib"] or 0, int(q.stdout.split()[0]))

    sampler = threading.Thread(target=sample, daemon=True)
    if gpu_memory:
        sampler.start()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, text=True,
                                errors="replace")
        timer = threading.Timer(limit_s, proc.terminate) if limit_s else None
        if timer:
            timer.start()
        for line in proc.stdout:  # one line per stage when not a terminal: where a step that timed out had got to
            f.write(f"[{time.perf_counter() - t:7.1f} s] {local(line)}")
            f.flush()
        rc = proc.wait()
        timed_out = bool(timer) and not timer.is_alive() and rc != 0
        if timer:
            timer.cancel()
    stop.set()
    seconds = time.perf_counter() - t
    rc = 124 if timed_out else rc
    tail = [local(line) for line in log.read_text(errors="replace").splitlines()[-12:]]
    print(f"plan_cost: {name}: {seconds:.0f} s (exit {rc}{', stopped at the limit' if timed_out else ''})", flush=True)
    out = {"command": local(shown or " ".join(shlex.quote(c) for c in cmd)), "seconds": seconds, "rc": rc,
           "tail": tail}
    if gpu_memory:
        out["gpu_memory_peak_mib"] = peak["mib"]
    return out


def environment(env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-c", "import json; from ffnquant.infra.envinfo import environment; "
                          "print(json.dumps(environment()))"], env=env, capture_output=True, text=True, cwd=REPO)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip().splitlines()[-1:]}


def fmt_s(x) -> str:
    return "-" if x is None else f"{x:,.0f} s"


def ratio(a, b) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def scored_candidates(plan: dict) -> dict:
    """What a plan.json says about the candidates scored on every layer: {scored: [...], not_scored: {recipe:
    why}}; under the latency objective which ones are scored depends on that run's latency table."""
    skipped = plan.get("not_scored") or {}
    later = plan.get("deferred") or {}
    only = plan.get("probes_unscored")  # absent: a plan of before they were left unscored, which scored every probe
    return {"scored": [r for r in plan.get("candidates", []) if r not in skipped and r not in later]
            + [p for p in plan.get("probes", []) if p in skipped and p not in (only or ())],
            "probes_unscored": only or [],
            "not_scored": skipped, "probes": plan.get("probes", []),
            "deferred": {r: len(layers) for r, layers in later.items()}, "layers": len(plan.get("layers") or {})}


# this run's --out when it lies outside the repository (written OUT in what the reports say)
_OUT: list[str] = []


def local(text: str) -> str:
    """`text` with no path of this machine: this interpreter as `python3`, the repository's own paths relative to it
    (what the steps run from), this run's output folder outside it as OUT, another installation's files by their
    path inside it."""
    text = text.replace(sys.executable + " ", "python3 ")
    for folder in _OUT:
        text = text.replace(folder, "OUT")
    text = re.sub(r"\S*/ffnquant-random-model-[^/\s]+", "<random-model>", text)  # this run's own checkpoint
    text = text.replace(str(REPO) + os.sep, "")
    for prefix in sorted({sys.prefix, sys.base_prefix, str(Path.home())}, key=len, reverse=True):
        text = text.replace(prefix + os.sep, "<python>" + os.sep if prefix != str(Path.home()) else "~" + os.sep)
    return text


def _verified(plan_dir: Path):
    """Whether the plan in `plan_dir` was verified (None where it wrote no plan.json)."""
    try:
        return bool(json.loads((plan_dir / "plan.json").read_text())["verified"])
    except (OSError, ValueError, KeyError):
        return None


def _pair_lines(pairs: list[dict]) -> list[str]:
    """The plan/peer pairs' table and their median ratio (more than one pair)."""
    if len(pairs) < 2:
        return []
    rows = [f"| {k} | {p['first']} | {fmt_s(p['plan_s'])} | {fmt_s(p['peer_s'])} | {ratio(p['plan_s'], p['peer_s'])} | "
            f"{ {True: 'yes', False: 'NO', None: '-'}[p['verified']] } |" for k, p in enumerate(pairs, 1)]
    ratios = sorted(p["plan_s"] / p["peer_s"] for p in pairs if p["plan_s"] and p["peer_s"])
    median = ratios[len(ratios) // 2] if len(ratios) % 2 else 0.5 * (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2])
    return ["## Plan and peer, in pairs", "",
            "Each pair: the default plan and the peer's oneshot right after each other, the order alternating (the "
            "machine is shared; its speed drifts over minutes).", "",
            "| pair | first | plan | peer | plan / peer | plan verified |", "|---:|---|---:|---:|---:|---|", *rows, "",
            f"Median of the {len(ratios)} pairs' ratios: **{median:.2f}x** (range {ratios[0]:.2f}x..{ratios[-1]:.2f}x).",
            ""]


def render(doc: dict, before: dict | None) -> str:
    steps, peer = doc["steps"], doc["steps"].get("peer", {}).get("seconds")
    plan_s = steps["plan"]["seconds"]
    export_s = steps.get("export", {}).get("seconds")
    lines = [f"# What a verified plan costs against llm-compressor's oneshot: {doc['model']}", "",
             f"Measured in one run on one machine ({doc['environment'].get('cpu', '?')}, "
             f"{doc['environment'].get('cpu_count', '?')} cores, torch threads "
             f"{doc['environment'].get('torch_threads', '?')}" + _gpu_label(doc['environment'])
             + f"; {doc['environment'].get('timestamp_utc', '')}), "
             "each step a subprocess, one after the other. Command:", "", "```bash", local(doc["command"]), "```", "",
             *([f"The checkpoint was built at run time in {fmt_s(doc['random_model_build_s'])} (not counted in any "
                "step).", ""] if doc.get("random_model_build_s") is not None else []),
             "| step | command | time | against the peer's oneshot |", "|---|---|---:|---:|"]
    for key, label in (("plan", "default plan to ppl+1%"), ("export", "export of that plan (with its proof)"),
                       ("apply_save", f"apply + save of {doc['recipe']}"), ("peer", "llm-compressor W8A8 oneshot")):
        if key in steps:
            command = local(steps[key]["command"])
            if key == "apply_save":  # a short script: `ffnquant.apply(model, recipe)` then `ffnquant.save(q, out)`
                command = f"ffnquant.apply(model, {doc['recipe']!r}); ffnquant.save(q, out)"
            stopped = " (stopped at the limit, unfinished)" if steps[key]["rc"] == 124 else ""
            lines.append(f"| {label} | `{command.replace('|', '/')}` | {fmt_s(steps[key]['seconds'])}{stopped} | "
                         f"{ratio(steps[key]['seconds'], peer) if key != 'peer' else '1.00x'} |")
    if export_s is not None:
        lines.append(f"| plan + export | | {fmt_s(plan_s + export_s)} | {ratio(plan_s + export_s, peer)} |")
    lines.append("")
    lines += _pair_lines(doc.get("pairs") or [])
    gpu_peaks = {k: s["gpu_memory_peak_mib"] for k, s in steps.items() if s.get("gpu_memory_peak_mib") is not None}
    if gpu_peaks:
        lines += ["GPU memory in use at its peak (nvidia-smi, sampled each second): "
                  + ", ".join(f"{k} {v / 1024:.1f} GiB" for k, v in gpu_peaks.items()) + ".", ""]
    if doc.get("apply_save"):
        a = doc["apply_save"]
        lines += [f"apply: {a['apply_s']:.0f} s; apply + save: {a['total_s']:.0f} s; proof: {a['verdict']}.", ""]
    lines += ["## The plan's time per stage", "",
              "| stage | what | " + ("before | " if before else "") + "now |",
              "|---|---|" + ("---:|" if before else "") + "---:|"]
    now_t = doc.get("plan_timings") or {}
    old_t = (before or {}).get("plan_timings") or {}
    for key, what in STAGES:
        if key in now_t or key in old_t:
            lines.append(f"| {key.removesuffix('_s')} | {what} | " + (f"{fmt_s(old_t.get(key))} | " if before else "")
                         + f"{fmt_s(now_t.get(key))} |")
    sc, old_sc = doc.get("plan_scored"), (before or {}).get("plan_scored")
    if sc:
        only = sc.get("probes_unscored") or []
        lines += ["", f"Scored on every layer: {len(sc['scored'])} candidates ({', '.join(sc['scored'])}"
                  + (f"; the probes {', '.join(p for p in sc['probes'] if p not in only)} always" if set(sc["probes"]) - set(only)
                     else "") + "). Not scored, as the latency table of this run says they can never "
                  f"be chosen: {', '.join(sc['not_scored']) or 'none'}"
                  + (f" ({', '.join(only)} only quantized, for the probes' ablations)" if only else "") + "."
                  + (" Scored only on the layers where a solution picked one (deferred): "
                     + ", ".join(f"{r} on {n} of {sc.get('layers', '?')} layers" for r, n in sc["deferred"].items()) + "."
                     if sc.get("deferred") else "")
                  + (f" Before: {len(old_sc['scored'])} scored ({', '.join(old_sc['scored'])})." if old_sc else "")]
    if before:
        b = before["steps"]
        lines += ["", f"Before: {before.get('source_label', 'another checkout')}: plan {fmt_s(b['plan']['seconds'])}"
                  + (f", export {fmt_s(b['export']['seconds'])}" if 'export' in b else "")
                  + (f", apply + save {fmt_s(b['apply_save']['seconds'])}" if 'apply_save' in b else "")
                  + (f"; the peer's oneshot in that run {fmt_s(b['peer']['seconds'])} (the plan "
                     f"{ratio(b['plan']['seconds'], b['peer']['seconds'])} of it)" if 'peer' in b else "") + "."]
    v = doc.get("plan_verified")
    if v:
        lines += ["", "## What the plan verified", "",
                  f"Plan: {v['layers']}. Verified: **{'yes' if v['verified'] else 'NO'}** after {v['rounds']} round(s).", "",
                  "| held-out domain | ppl change | 95% CI | KL mean | top-1 | tokens |", "|---|---:|---|---:|---:|---:|"]
        for label, fig in v["domains"].items():
            ci = fig.get("perplexity_ratio_ci") or [None, None]
            lines.append(f"| {label} | {_pct(fig.get('perplexity_ratio'))} | {_pct(ci[0])}..{_pct(ci[1])} | "
                         f"{(fig.get('kl') or {}).get('mean', 0):.4f} | {100 * (fig.get('top1_agreement') or 0):.1f}% | "
                         f"{fig.get('n_predicted', '-')} |")
    if doc.get("export_proof"):
        lines += ["", f"Export: {doc['export_proof']}."]
    failed = [k for k, s in steps.items() if s["rc"] != 0]
    if failed:
        lines += ["", "## Steps that failed", ""]
        for k in failed:
            lines += [f"- {k} (exit {steps[k]['rc']}):", "", "```", *steps[k]["tail"], "```"]
    return "\n".join(lines) + "\n"


def _gpu_label(env: dict) -> str:
    gpu = env.get("gpu")
    return f"; GPU {gpu['name']} ({gpu['memory_gib']} GiB, CUDA {gpu['cuda']})" if gpu else "; no GPU"


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _shape_label(shape: dict) -> str:
    return (f"{shape['layers']} layers, d_model {shape['d']}, d_ff {shape['f']}, {shape['heads']} heads "
            f"({shape['kv_heads']} KV), vocab {shape['vocab']}")


def _pct(r) -> str:
    return "-" if r is None else f"{100 * (r - 1):+.2f}%"


def _localise(path: Path) -> None:
    """A text file this run wrote, with no path of this machine in it (`local`)."""
    if path.exists():
        path.write_text(local(path.read_text(errors="replace")))


def _rel(path: Path) -> Path:
    """`path` relative to the repository root where it lies inside it (the steps run there)."""
    try:
        return path.relative_to(REPO)
    except ValueError:
        return path


def truncated(model: str, n: int, folder: Path) -> str:
    """A copy of `model` with only its first `n` decoder layers (config and weights), written once."""
    if (folder / "config.json").exists():
        return str(folder)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model)
    config.num_hidden_layers = n
    for key in ("layer_types",):  # per-layer lists follow the cut
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, getattr(config, key)[:n])
    lm = AutoModelForCausalLM.from_pretrained(model, config=config, dtype=torch.float32)
    lm.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model).save_pretrained(folder)
    return str(folder)


# --random-model: checkpoints built at run time, random weights in bf16 (latency and cost do not depend on the values;
# the device has no checkpoint). llama3-8b is Llama-3-8B's shapes; tiny is the same code path in seconds.
RANDOM_MODELS = {
    "llama3-8b": dict(layers=32, d=4096, f=14336, heads=32, kv_heads=8, vocab=128256, layers_per_shard=4),
    "tiny": dict(layers=4, d=128, f=448, heads=4, kv_heads=2, vocab=4096, layers_per_shard=2),
}


def random_model(name: str, root: Path, device: str) -> tuple[str, float]:
    """Write the random-weight Llama `name` (RANDOM_MODELS) under `root`, its weights drawn on `device`: (folder,
    seconds)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from scale import write_checkpoints

    t = time.perf_counter()
    shape = RANDOM_MODELS[name]
    folder = write_checkpoints(root, shape["layers"], shape["d"], shape["f"], shape["heads"], shape["kv_heads"],
                               shape["vocab"], shape["layers_per_shard"], device=device)[shape["layers"]]
    return str(folder), time.perf_counter() - t


def _commit_label(checkout: Path) -> str:
    """'commit abc1234' (and whether the checkout had uncommitted changes to the package), or 'a checkout'."""
    try:
        sha = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--", "ffnquant"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "a checkout"
    return f"commit {sha}" + (" with uncommitted changes to ffnquant/" if dirty else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--out", help="folder for plan_cost.json / plan_cost.md and each step's output")
    ap.add_argument("--peer-python", default="peer-venv/bin/python", help="an interpreter that has llm-compressor")
    ap.add_argument("--peer-samples", type=int, default=64)
    ap.add_argument("--skip-peer", action="store_true")
    ap.add_argument("--skip-export", action="store_true")
    ap.add_argument("--skip-apply", action="store_true")
    ap.add_argument("--recipe", default="w8a8-dynamic-s8", help="the one recipe of the apply + save step")
    ap.add_argument("--plan-args", default="", help="more arguments of the plan command (default: none)")
    ap.add_argument("--export-args", default="", help="more arguments of the export command")
    ap.add_argument("--source", default=None, help="run ffnquant from this checkout (PYTHONPATH) instead of this one")
    ap.add_argument("--before", default=None, help="an earlier plan_cost.json to show beside this run")
    ap.add_argument("--pairs", type=int, default=1,
                    help="plan and peer runs, in pairs right after each other, the order alternating (plan first, "
                         "then peer first, ...): on a shared machine whose speed drifts, each pair's ratio and "
                         "their median (default 1)")
    ap.add_argument("--layers", type=int, default=None,
                    help="run on a copy of the model cut to its first N decoder layers (written to OUT/model-first-N; "
                         "a before/after of the stages at a fraction of the time; not a figure of the whole model)")
    ap.add_argument("--random-model", choices=sorted(RANDOM_MODELS), default=None,
                    help="plan a random-weight bf16 Llama built at run time instead of --model (llama3-8b: Llama-3-8B's "
                         "shapes; tiny: the same code path in seconds), its weights drawn on a GPU where there is one")
    ap.add_argument("--step-limit-s", type=float, default=None,
                    help="stop a step past this many seconds (SIGTERM; reported as stopped, with how far it got)")
    ap.add_argument("--progress", action="store_true",
                    help="keep the plan's progress lines in its log (one per stage), each with its elapsed seconds")
    ap.add_argument("--stacks-every", type=float, default=None, metavar="S",
                    help="write the plan's Python stacks every S seconds to OUT/plan.stacks (faulthandler): where a "
                         "slow stage spends its time, on a machine without a profiler")
    ap.add_argument("--render", default=None, metavar="JSON",
                    help="only write plan_cost.md again from a plan_cost.json (beside it), running nothing")
    args = ap.parse_args(argv)
    if args.render:
        path = Path(args.render)
        doc = json.loads(path.read_text())
        before = ({**doc["before"], "steps": doc["before"]["steps"]} if doc.get("before") else None)
        (path.parent / "plan_cost.md").write_text(render(doc, before))
        return 0
    if not (args.model or args.random_model) or not args.out:
        ap.error("--model (or --random-model) and --out are required (or --render JSON)")
    out = Path(args.out).resolve()
    random_root = None
    if args.random_model:
        import tempfile

        import torch

        random_root = Path(tempfile.mkdtemp(prefix="ffnquant-random-model-"))
        where = "cuda" if torch.cuda.is_available() else "cpu"
        print(f"plan_cost: writing the random-weight {args.random_model} checkpoint (drawn on {where}) ...", flush=True)
        args.model, build_s = random_model(args.random_model, random_root, where)
        print(f"plan_cost: checkpoint written in {build_s:.0f} s", flush=True)
    model_path = Path(args.model).resolve()
    before_path = Path(args.before).resolve() if args.before else None
    os.chdir(REPO)  # every step runs from the repository root, on relative paths: the reports name no folder here
    out = _rel(out)
    out.mkdir(parents=True, exist_ok=True)
    if out.is_absolute():
        _OUT[:] = [str(out)]
    env = dict(os.environ)
    src = Path(args.source).resolve() if args.source else REPO
    env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    py = sys.executable
    model = str(_rel(model_path))
    if args.layers:
        model = truncated(model, args.layers, out / f"model-first-{args.layers}")
    steps: dict[str, dict] = {}
    plan_dir, export_dir, save_dir = out / "plan", out / "export", out / "apply-save"
    for d in (plan_dir, export_dir, save_dir):  # this benchmark's own outputs from an earlier run of it
        subprocess.run(["rm", "-rf", str(d)])
    gpu = "cuda" in args.plan_args or (args.random_model is not None and _has_cuda())
    def plan_command(folder: Path, progress: bool = False) -> list[str]:
        return [py, "-m", "ffnquant", "plan", "--model", model, "--target", "ppl+1%", "--out", str(folder),
                *([] if progress else ["--no-progress"]), *shlex.split(args.plan_args)]

    plan_cmd = plan_command(plan_dir, args.progress)
    shown = None
    if args.stacks_every:  # the command as a user runs it; the sampler is this benchmark's
        shown = " ".join(shlex.quote(c) for c in plan_cmd) + f"  # its stacks sampled every {args.stacks_every:g} s"
        plan_cmd = sampled(plan_cmd, args.stacks_every, out / "plan.stacks")
    steps["plan"] = run_step("plan", plan_cmd, env, out / "plan.log", limit_s=args.step_limit_s, gpu_memory=gpu,
                             shown=shown)
    for name in ("plan.stacks", "plan/plan.md", "plan/plan.toml", "plan/plan.json"):  # they name its --out
        _localise(out / name)

    def peer_cmd(folder: str) -> list[str]:
        return [str(Path(args.peer_python)), str(REPO / "benchmarks/peer_llmcompressor.py"), "--model", model,
                "--samples", str(args.peer_samples), "--output", str(out / folder), "--provenance",
                str(out / "peer.provenance.json")]

    pairs = []
    if not args.skip_peer:  # right after the plan: the two timed on the machine as it is then
        steps["peer"] = run_step("peer", peer_cmd("peer-folder"), env, out / "peer.log")
        _localise(out / "peer.provenance.json")  # it names the paths it was given
        pairs.append({"plan_s": steps["plan"]["seconds"], "peer_s": steps["peer"]["seconds"], "first": "plan",
                      "verified": _verified(plan_dir)})
        for k in range(2, args.pairs + 1):
            folder = out / f"plan-pair{k}"
            subprocess.run(["rm", "-rf", str(folder)])
            cmd = plan_command(folder)
            order = ["peer", "plan"] if k % 2 == 0 else ["plan", "peer"]
            got = {}
            for name in order:
                got[name] = (run_step(f"peer_pair{k}", peer_cmd(f"peer-folder-pair{k}"), env, out / f"peer-pair{k}.log")
                             if name == "peer" else
                             run_step(f"plan_pair{k}", cmd, env, out / f"plan-pair{k}.log", limit_s=args.step_limit_s))
                steps[f"{name}_pair{k}"] = got[name]
            subprocess.run(["rm", "-rf", str(out / f"peer-folder-pair{k}")])  # the peer's folder: its time is the point
            pairs.append({"plan_s": got["plan"]["seconds"], "peer_s": got["peer"]["seconds"], "first": order[0],
                          "verified": _verified(folder)})
    if not args.skip_export and steps["plan"]["rc"] == 0:
        steps["export"] = run_step("export", [py, "-m", "ffnquant", "export", "--model", model, "--plan",
                                              str(plan_dir / "plan.toml"), "--out", str(export_dir), "--no-progress",
                                              *shlex.split(args.export_args)], env, out / "export.log",
                                     limit_s=args.step_limit_s, gpu_memory=gpu)
    apply_save = None
    if not args.skip_apply:
        steps["apply_save"] = run_step("apply_save", [py, "-c", APPLY_SAVE, model, args.recipe, str(save_dir)],
                                       env, out / "apply_save.log")
        for line in (out / "apply_save.log").read_text(errors="replace").splitlines():
            if line.startswith("APPLY_SAVE "):
                _, a, total, verdict = line.split(" ", 3)
                apply_save = {"apply_s": float(a), "total_s": float(total), "verdict": verdict}
    label = (f"random-weight bf16 Llama, {args.random_model} shapes ({_shape_label(RANDOM_MODELS[args.random_model])})"
             if args.random_model else Path(args.model).name + (f" (first {args.layers} layers)" if args.layers else ""))
    doc = {"model": label, "recipe": args.recipe, "steps": steps, "apply_save": apply_save, "pairs": pairs,
           "command": local(" ".join(shlex.quote(a) for a in [sys.executable, os.path.relpath(__file__, REPO)]
                                     + list(argv if argv is not None else sys.argv[1:]))),
           "source_label": _commit_label(Path(args.source) if args.source else REPO),
           "environment": environment(env)}
    try:
        plan = json.loads((plan_dir / "plan.json").read_text())
        final = plan["rounds"][plan["final_round"] - 1]
        doc["plan_timings"] = plan.get("timings")
        doc["plan_scored"] = scored_candidates(plan)
        recipes: dict[str, int] = {}
        for name in final["layers"].values():
            recipes[name] = recipes.get(name, 0) + 1
        doc["plan_verified"] = {"verified": plan["verified"], "rounds": len(plan["rounds"]),
                                "layers": "; ".join(f"{r}: {n} layer(s)" for r, n in recipes.items()),
                                "domains": final["domains"]}
    except (OSError, ValueError, KeyError) as exc:
        doc["plan_error"] = f"{type(exc).__name__}: {exc}"
    try:
        dep = json.loads((export_dir / "ffnquant-deploy.json").read_text())
        from ffnquant.wholemodel import DeployReport  # the same verdict ffnquant.save reports

        proven = DeployReport(export_dir, dep).proven
        doc["export_proof"] = (f"{dep.get('format')}: " + {True: "proven", False: "NOT proven",
                                                           None: "nothing to prove (per-layer artifacts)"}[proven])
    except (OSError, ValueError):
        pass
    before = json.loads(before_path.read_text()) if before_path else None
    if before:
        doc["before"] = {k: before.get(k) for k in ("steps", "plan_timings", "plan_scored", "source_label", "environment")}
    if random_root is not None:
        doc["random_model_build_s"] = build_s
        subprocess.run(["rm", "-rf", str(random_root)])  # this run's own checkpoint
    (out / "plan_cost.json").write_text(json.dumps(doc, indent=1, default=str))
    (out / "plan_cost.md").write_text(render(doc, before))
    print(f"plan_cost: wrote {local(str(out / 'plan_cost.md'))}")
    return 0 if all(s["rc"] == 0 for s in steps.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
