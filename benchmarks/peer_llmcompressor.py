"""Peer baseline: llm-compressor's W8A8 (SmoothQuant + GPTQ) on SmolLM2's FFN Linears only.

Run with the interpreter of a separate virtual environment that has llm-compressor, so the
project's own environment is not disturbed (llm-compressor pins its own transformers and
compressed-tensors):

    python3 -m venv peer-venv
    peer-venv/bin/pip install torch==2.13.0      # CPU wheel first
    peer-venv/bin/pip install llmcompressor
    peer-venv/bin/python benchmarks/peer_llmcompressor.py

It never imports ffnquant. The recipe is llm-compressor's W8A8 int8 example
(examples/quantization_w8a8_int8: SmoothQuantModifier(smoothing_strength=0.8) then
GPTQModifier(scheme="W8A8", ignore=["lm_head"])) narrowed to the FFN: GPTQ targets
`re:.*mlp\\.(gate|up|down)_proj$` only, and SmoothQuant keeps only its default Llama mapping
that feeds the FFN (post_attention_layernorm -> gate_proj, up_proj); the other default
mapping (input_layernorm -> q/k/v) is left out because attention stays float (there it would
only rescale float weights). W8A8 is int8 symmetric per-channel weights (GPTQ) and dynamic
per-token symmetric int8 activations. Attention, embeddings, norms and lm_head stay float.

Calibration: the shipped prose calibration corpus (gzip'd JSONL of documents), cut into
512-token windows the way benchmarks/independent_score.py cuts evaluation text (each
document tokenized without special tokens, consecutive windows from its start, BOS only if the
tokenizer adds one, EOS appended to a document's last window when there is room, windows under
16 tokens dropped); of those, --samples windows evenly spaced over the corpus (llm-compressor's
W8A8 example uses 512; on this 2-core machine fewer were affordable, see the provenance JSON). The compressed folder
goes to models/peer/llmc-w8a8-ffn/ and a provenance JSON to reports/trained-llm/peer/.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import shlex
import sys
import time
from importlib import metadata

import torch

FFN_REGEX = r"re:.*mlp\.(gate|up|down)_proj$"
MIN_WINDOW = 16


def read_documents(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    stem = path[:-3] if path.endswith(".gz") else path
    with opener(path, "rt", encoding="utf-8") as f:
        if stem.endswith(".jsonl"):
            docs = []
            for line in f:
                if line.strip():
                    obj = json.loads(line)
                    docs.append(obj if isinstance(obj, str) else obj["text"])
            return docs
        return [f.read()]


def windows(tokenizer, docs, seq_len, max_windows):
    probe = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id if (tokenizer.bos_token_id is not None and probe
                                     and probe[0] == tokenizer.bos_token_id) else None
    eos = tokenizer.eos_token_id
    body = seq_len - 1 if bos is not None else seq_len
    out = []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        for start in range(0, len(ids), body):
            w = ([bos] if bos is not None else []) + ids[start:start + body]
            if start + body >= len(ids) and eos is not None and len(w) < seq_len:
                w.append(eos)
            if len(w) >= MIN_WINDOW:
                out.append(w)
    available = len(out)
    if len(out) > max_windows:
        # evenly spaced over the whole corpus, so both of its sources (the corpus stores them one
        # after the other) are in the calibration set, not only the first
        idx = [round(i * (len(out) - 1) / (max_windows - 1)) for i in range(max_windows)] if max_windows > 1 else [0]
        out = [out[i] for i in idx]
    return out, available


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def versions():
    v = {}
    for p in ("llmcompressor", "compressed-tensors", "transformers", "torch", "accelerate", "datasets"):
        try:
            v[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            v[p] = None
    return v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--calibration", default="ffnquant/data/corpora/prose-calibration.jsonl.gz")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--samples", type=int, default=512, help="at most this many windows (llm-compressor's examples: 512)")
    ap.add_argument("--smoothing-strength", type=float, default=0.8)
    ap.add_argument("--output", default="models/peer/llmc-w8a8-ffn")
    ap.add_argument("--provenance", default="reports/trained-llm/peer/llmc-w8a8-ffn.provenance.json")
    ap.add_argument("--pipeline", default=None,
                    help="llm-compressor calibration pipeline (default: its own choice, 'independent' -> sequential "
                         "per decoder layer); 'basic' runs whole-model forwards")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # relative to where it runs: a report names no folder of this machine
    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable), os.path.relpath(sys.argv[0])] + sys.argv[1:])

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    t_start = time.time()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    docs = read_documents(args.calibration)
    wins, available = windows(tokenizer, docs, args.seq_len, args.samples)
    ds = Dataset.from_dict({"input_ids": wins, "attention_mask": [[1] * len(w) for w in wins]})
    n_tokens = sum(map(len, wins))
    print(f"calibration: {len(docs)} documents -> {len(wins)} windows, {n_tokens} tokens", flush=True)

    recipe = [
        SmoothQuantModifier(
            smoothing_strength=args.smoothing_strength,
            mappings=[[["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]],
        ),
        GPTQModifier(targets=[FFN_REGEX], scheme="W8A8", ignore=["lm_head"]),
    ]
    t0 = time.time()
    oneshot(
        model=model,
        tokenizer=tokenizer,
        dataset=ds,
        recipe=recipe,
        max_seq_length=args.seq_len,
        num_calibration_samples=len(wins),
        shuffle_calibration_samples=False,
        **({"pipeline": args.pipeline} if args.pipeline else {}),
    )
    t_oneshot = time.time() - t0
    t1 = time.time()
    os.makedirs(args.output, exist_ok=True)
    model.save_pretrained(args.output, save_compressed=True)
    tokenizer.save_pretrained(args.output)
    t_save = time.time() - t1

    quantized = [n for n, m in model.named_modules() if getattr(m, "quantization_scheme", None) is not None]
    with open(os.path.join(args.output, "config.json")) as f:
        qcfg = json.load(f).get("quantization_config")
    prov = {
        "command": command,
        "versions": versions(),
        "python": platform.python_version(),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
        "model": args.model,
        "output": args.output,
        "recipe": [repr(m) for m in recipe],
        "recipe_notes": ("llm-compressor's W8A8 int8 example recipe (SmoothQuant 0.8 + GPTQ W8A8, ignore lm_head) "
                         "narrowed to the FFN Linears; SmoothQuant's FFN mapping only (attention stays float)"),
        "pipeline": args.pipeline or "llm-compressor default (independent: sequential per decoder layer)",
        "quantized_modules": len(quantized),
        "quantized_modules_sample": quantized[:3],
        "quantization_config": qcfg,
        "calibration": {"file": args.calibration, "sha256": sha256(args.calibration), "documents": len(docs),
                        "samples": len(wins), "tokens": n_tokens, "seq_len": args.seq_len,
                        "sample_cap": args.samples, "shuffled": False,
                        "selection": "windows evenly spaced over all of the corpus's windows",
                        "windows_available": available},
        "seconds": {"oneshot": t_oneshot, "save": t_save, "total": time.time() - t_start},
    }
    os.makedirs(os.path.dirname(args.provenance) or ".", exist_ok=True)
    with open(args.provenance, "w") as f:
        json.dump(prov, f, indent=1, default=str)
    print(json.dumps(prov["seconds"]), flush=True)
    return 0


def _cpu():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
