#!/usr/bin/env python3
"""Peak memory of `ffnquant export --model --plan --format compressed-tensors`, which holds the whole model, against
the estimate its up-front check refuses on (`hf.memory.export_peak`).

Models (random bf16 weights, the tests' word-level tokenizer): a dense Llama (hidden 2048, FFN 5632, 8 layers) and
one Qwen3-MoE decoder layer at Qwen3-30B-A3B's widths (hidden 2048, experts 768 wide, top-8) with 32 and with 128
experts. Each is exported under a plan giving every layer one 4-bit recipe (w4a16-g128 dense, w4a16-g64 experts),
proven in transformers, in a child process whose peak RSS is the kernel's high-water mark (`scale.measure`).

Usage:
  PYTHONPATH=.:tests python benchmarks/export_memory.py --out reports/export-memory
Writes OUT/export_memory.json and OUT/export_memory.md (stamped with the machine, versions and the command).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MODELS = {
    "llama-d2048-8L": dict(kind="dense", recipe="w4a16-g128"),
    "qwen3-30b-a3b-e32": dict(kind="experts", recipe="w4a16-g64"),
    "qwen3-30b-a3b": dict(kind="experts", recipe="w4a16-g64"),
}


def _dense(folder: Path) -> Path:
    import transformers as T

    import hf_models
    import vllm_experts

    T.logging.set_verbosity_error()
    config = T.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                           num_key_value_heads=4, head_dim=128, vocab_size=hf_models.VOCAB, max_position_embeddings=2048)
    return vllm_experts._save(config, folder)  # bf16 random weights, the tests' tokenizer


def _estimate(folder: Path) -> dict:
    """The check's estimate without this process's own memory (the child starts from its imports)."""
    from ffnquant.hf import inspect_model, memory

    info = inspect_model(folder)
    experts = sum(info.spec.n_params for layer in info.layers if layer.expert is not None)
    return {"params": info.n_params_total, "expert_params": experts,
            "estimate_bytes": memory.export_peak(info) - memory.process_rss()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown or not names:
        print(f"unknown model(s) {', '.join(unknown) or '(none)'}; valid: {', '.join(MODELS)}", file=sys.stderr)
        return 2
    import hf_models
    import scale
    import vllm_experts
    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment
    from ffnquant.infra.render import markdown_table
    from ffnquant.infra.resources import human_bytes

    t0 = time.time()
    rows = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(scale.ROOT), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory(prefix="export-memory-") as tmp:
        for name in names:
            folder = Path(tmp) / name
            spec = MODELS[name]
            _dense(folder) if spec["kind"] == "dense" else vllm_experts.shape_model(name, folder)
            plan = hf_models.one_recipe_plan(folder, spec["recipe"], folder.parent / f"{name}.plan.toml")
            cmd = [sys.executable, "-m", "ffnquant", "export", "--model", str(folder), "--plan", str(plan), "--format",
                   "compressed-tensors", "--calib-tokens", "256", "--eval-tokens", "128", "--seq-len", "128",
                   "--no-progress", "--out", str(Path(tmp) / f"{name}-out")]
            res = scale.measure(cmd, env)
            proven = any(line.startswith("written: ") for line in res["lines"]) and res["rc"] == 0
            rows.append({"model": name, "recipe": spec["recipe"], **_estimate(folder), "rc": res["rc"],
                         "proven": proven, "seconds": res["seconds"], "peak_rss_bytes": res["peak_rss_bytes"],
                         "output_tail": res["output_tail"]})
            print(f"{name}: rc {res['rc']}, peak {human_bytes(res['peak_rss_bytes'])}, {res['seconds']:.0f} s",
                  file=sys.stderr)
    command = "PYTHONPATH=.:tests python benchmarks/export_memory.py " + shlex.join(
        [*(["--models", args.models] if args.models != ",".join(MODELS) else []), "--out", args.out])
    doc = {"command": command, "environment": environment(), "seconds": time.time() - t0, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "export_memory.json", doc)
    table = markdown_table(
        ["model", "parameters", "of them routed experts", "recipe", "exit", "proven", "peak RSS", "estimate",
         "peak / estimate", "seconds"],
        [[r["model"], f"{r['params'] / 1e9:.3f}B", f"{r['expert_params'] / 1e9:.3f}B", r["recipe"], r["rc"],
          "yes" if r["proven"] else "no", human_bytes(r["peak_rss_bytes"]), human_bytes(r["estimate_bytes"]),
          f"{r['peak_rss_bytes'] / r['estimate_bytes']:.2f}", f"{r['seconds']:.0f}"] for r in rows])
    env_line = doc["environment"]
    write_text(out / "export_memory.md", "\n".join([
        "# Export's peak memory against its up-front estimate", "",
        f"Command: `{command}`", "",
        "`ffnquant export --model M --plan P --format compressed-tensors --calib-tokens 256 --eval-tokens 128 "
        "--seq-len 128` (the whole model held in memory, the folder written and proven in transformers), each in a "
        "child process; peak RSS is the kernel's high-water mark of it (ru_maxrss). The estimate is "
        "`hf.memory.export_peak` (what the check refuses on) without the benchmark process's own memory.", "",
        table, "",
        f"_{env_line['timestamp_utc']} on {env_line.get('cpu', '?')} ({env_line.get('cpu_count')} cores), torch "
        f"{env_line['packages'].get('torch')}, transformers {env_line['packages'].get('transformers')}; "
        f"{doc['seconds'] / 60:.0f} min in all._", ""]))
    print(f"wrote {out / 'export_memory.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
