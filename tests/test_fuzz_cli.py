"""Fuzz suite of bad input to every command (issue 15): each is a clean refusal and writes nothing.

Every case in CASES runs one command line against a fresh temporary folder laid out like a
user's working folder after an earlier run:

    out/   reports of an earlier run (keep.txt, latency.json/.md, report.json, ranges.json, ...)
    exp/   artifacts of an earlier run (relu_d32_ff128.w8a8.onnx, relu_d32_ff128.fp32.onnx)
    new    a folder that does not exist yet
    in/    the case's inputs (token files, config files, model folders), made by its setup

and asserts what the README promises for bad input: exit code 2, exactly one non-empty line
on stderr that names the problem (each case names a few words of which one must appear),
no traceback, and not one file, folder, FIFO or byte in the whole temporary folder added,
removed or changed (so pre-existing good files are byte-identical and no `*.tmp`,
`*.partial` or staging folder is left). Beside the table: outputs whose name is held by an
immutable file (`test_immutable_target_is_refused`, where chattr works), successes that must
keep earlier files and sweep stale temporaries (`SUCCESSES`), Ctrl-C and a full disk
simulated mid-write (`test_interrupted_mid_write_leaves_nothing`) and a real SIGINT sent
to a running `bench` (`test_real_sigint_mid_bench_leaves_nothing`).

Most cases run in-process (`ffnquant.cli.main`, fast: refusals come before any heavy
work) under a watchdog; the ones that can block in a system call or a long C loop (FIFOs,
sizes that must be refused before allocating) run as `python -m ffnquant` subprocesses with
a 20 s timeout, started together in the background when the first case runs so that the
whole file stays within about a minute on 2 cores (the cases are one xdist group: one worker
starts them and runs every case that waits for one).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from ffnquant.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from hf_models import write_llama_like  # noqa: E402

IS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0
SUBPROCESS_TIMEOUT_S = 20.0
IN_PROCESS_TIMEOUT_S = 20.0
BIG = "1000000000"

# --- the folder layout of every case -----------------------------------------------------

EARLIER = {
    "out/keep.txt": b"a user's notes: never touched by ffnquant\n",
    "out/latency.json": b'{"earlier": "latency"}\n',
    "out/latency.md": b"# earlier latency\n",
    "out/report.json": b'{"earlier": "report"}\n',
    "out/run.toml": b"# earlier run.toml\n",
    "out/ranges.json": b'{"earlier": "ranges"}\n',
    "exp/relu_d32_ff128.w8a8.onnx": b"earlier w8a8 artifact (not a real ONNX file, compared byte for byte)",
    "exp/relu_d32_ff128.fp32.onnx": b"earlier fp32 artifact",
}


def make_layout(root: Path) -> dict[str, str]:
    """The earlier run's files under `root`; returns the placeholders of the case argv."""
    for rel, data in EARLIER.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    (root / "in").mkdir()
    return {"tmp": str(root), "out": str(root / "out"), "exp": str(root / "exp"), "new": str(root / "new"),
            "in": str(root / "in")}


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under `root` with its kind, mode and (regular files) bytes; FIFOs are never opened."""
    entries: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISREG(st.st_mode):
                try:
                    entries[rel] = ("file", mode, p.read_bytes())
                except PermissionError:  # a mode-000 input of a permission case (non-root only)
                    entries[rel] = ("file", mode, st.st_size, st.st_mtime_ns)
            elif stat.S_ISDIR(st.st_mode):
                entries[rel] = ("dir", mode)
            elif stat.S_ISLNK(st.st_mode):
                entries[rel] = ("link", os.readlink(p))
            else:
                entries[rel] = ("special", stat.S_IFMT(st.st_mode))
    return entries


def diff(before: dict, after: dict) -> list[str]:
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    return [f"new: {k}" for k in added] + [f"removed: {k}" for k in removed] + [f"changed: {k}" for k in changed]


def leftovers(root: Path) -> list[str]:
    """Temporary names (ours or anyone's) under `root`: `*.tmp`, `*.partial`, staging folders."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            if name.endswith((".tmp", ".partial")) or "staging" in name:
                found.append(str((Path(dirpath) / name).relative_to(root)))
    return sorted(found)


# --- inputs ----------------------------------------------------------------------------

def npy(name: str, array_fn: Callable[[], np.ndarray], allow_pickle: bool = False) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        np.save(root / "in" / name, array_fn(), allow_pickle=allow_pickle)
    return setup


def rows(n: int = 128, d: int = 32, dtype: str = "<f4") -> np.ndarray:
    return np.random.default_rng(0).standard_normal((n, d)).astype(dtype)


def write(rel: str, data: bytes | str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        p = root / "in" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data.encode() if isinstance(data, str) else data)
    return setup


def fifo(rel: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        p = root / "in" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(p)
    return setup


def folder(rel: str) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        (root / "in" / rel).mkdir(parents=True)
        (root / "in" / rel / "inside.txt").write_text("a folder, not a file\n")
    return setup


def chain(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        for s in setups:
            s(root)
    return setup


def truncated_npy(root: Path) -> None:
    np.save(root / "in" / "x.npy", rows())
    data = (root / "in" / "x.npy").read_bytes()
    (root / "in" / "x.npy").write_bytes(data[: len(data) // 2])


def float128_npy(root: Path) -> None:
    if np.dtype(np.longdouble).itemsize <= 8:
        pytest.skip("numpy has no extended-precision float here")
    np.save(root / "in" / "x.npy", rows().astype(np.longdouble))


def two_tensor_safetensors(root: Path) -> None:
    from safetensors.numpy import save_file

    save_file({"a": rows(), "b": rows()}, str(root / "in" / "x.safetensors"))


def _save_safetensors(path: Path, arrays: dict) -> None:
    from safetensors.numpy import save_file

    save_file(arrays, str(path))


def int_safetensors(root: Path) -> None:
    from safetensors.numpy import save_file

    save_file({"acts": np.arange(128 * 32, dtype=np.int32).reshape(128, 32)}, str(root / "in" / "x.safetensors"))


def config_toml(text: str) -> Callable[[Path], None]:
    return write("run.toml", text)


# A valid run.toml for a tiny run, edited by the config cases (the key order of `ffnquant run`'s own).
GOOD_TOML = """\
variants = ["relu"]
d_model = 32
calib_tokens = 256
eval_tokens = 128
batch_size = 128
bins = 64
schemes = ["fp32", "w8a8@minmax"]
runtimes = ["none"]
sensitivity = false
"""


def model(rel: str = "m", **config_changes) -> Callable[[Path], None]:
    """A hand-written llama-like checkpoint (d 32, d_ff 64, 2 layers; safetensors), config.json edited."""
    def setup(root: Path) -> None:
        folder = root / "in" / rel
        write_llama_like(folder)
        if config_changes:
            cfg = json.loads((folder / "config.json").read_text())
            cfg.update(config_changes)
            (folder / "config.json").write_text(json.dumps(cfg))
    return setup


def model_file(rel: str, data: bytes | str | None = None, kind: str = "file") -> Callable[[Path], None]:
    """Replace one file of the model folder `in/m` with bytes, a folder or a FIFO."""
    def setup(root: Path) -> None:
        p = root / "in" / "m" / rel
        if p.exists():
            p.unlink()
        if kind == "fifo":
            os.mkfifo(p)
        elif kind == "dir":
            p.mkdir()
        else:
            p.write_bytes(data.encode() if isinstance(data, str) else data)
    return setup


def sharded_index(shard: str, place_outside: bool = True) -> Callable[[Path], None]:
    """in/m with its weights moved to in/elsewhere/model.safetensors and an index mapping every tensor to `shard`."""
    def setup(root: Path) -> None:
        from safetensors import safe_open

        folder = root / "in" / "m"
        single = folder / "model.safetensors"
        with safe_open(str(single), framework="pt") as fh:
            names = list(fh.keys())
        outside = root / "in" / "elsewhere"
        outside.mkdir()
        if place_outside:
            single.rename(outside / "model.safetensors")
        else:
            single.unlink()
        index = {"metadata": {}, "weight_map": {n: shard.format(outside=outside) for n in names}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return setup


class _NotATensor:  # pickled by reference: weights-only loading refuses the global
    pass


class _Malicious:
    def __reduce__(self):  # what a malicious checkpoint does: call something on unpickling
        return (os.getcwd, ())


def pickled(obj_fn: Callable[[], object], name: str = "pytorch_model.bin") -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        folder = root / "in" / "m"
        (folder / "model.safetensors").unlink()
        torch.save(obj_fn(), folder / name)
    return setup


def captured(d: int = 32, n: int = 64, nan: bool = False, layers=("L0", "L1")) -> Callable[[Path], None]:
    """in/cal and in/ev: captured FFN inputs per layer (as `ffnquant model capture` writes them)."""
    def setup(root: Path) -> None:
        for split, count in (("cal", n), ("ev", n // 2)):
            (root / "in" / split).mkdir(exist_ok=True)
            for label in layers:
                x = rows(count, d)
                if nan:
                    x[3, 5] = np.nan
                np.save(root / "in" / split / f"{label}.npy", x)
    return setup


def tokenized_model_with(vocab_size: int = 96, embedding: Callable[[], torch.Tensor] | None = None,
                         **config_changes) -> Callable[[Path], None]:
    """`tokenized_model`, config.json edited and (given) a token embedding written beside the FFN weights."""
    def setup(root: Path) -> None:
        tokenized_model(vocab_size)(root)
        folder = root / "in" / "m"
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(config_changes)
        (folder / "config.json").write_text(json.dumps(cfg))
        if embedding is not None:
            from safetensors.torch import load_file, save_file

            state = load_file(str(folder / "model.safetensors"))
            state["model.embed_tokens.weight"] = embedding()
            save_file(state, str(folder / "model.safetensors"))
    return setup


def _embedding_with(value: float, vocab: int = 96, d: int = 32) -> torch.Tensor:
    table = torch.randn(vocab, d, generator=torch.Generator().manual_seed(0))
    table[7, 3] = value
    return table


def tokenized_model(vocab_size: int) -> Callable[[Path], None]:
    """in/m: a one-layer llama checkpoint (FFN weights only; transformers fills in the rest) whose config says
    `vocab_size`, with a 96-word tokenizer of its own (ids 0-95), written with `tokenizers` alone."""
    def setup(root: Path) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        from ffnquant.hf.capture import default_text_path

        folder = root / "in" / "m"
        write_llama_like(folder, layers=1)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(vocab_size=vocab_size, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                   architectures=["LlamaForCausalLM"])
        (folder / "config.json").write_text(json.dumps(cfg))
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(vocab_size=96, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
        tok.train([str(default_text_path("calibration"))], trainer)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "pad_token": "<pad>",
            "bos_token": "<s>", "eos_token": "</s>"}))
    return setup


def replace_with_dir(rel: str) -> Callable[[Path], None]:
    """Put a folder (holding a file) where an output file of that name would go."""
    def setup(root: Path) -> None:
        p = root / rel
        if p.exists():
            p.unlink()
        p.mkdir(parents=True)
        (p / "a user's file.txt").write_text("inside a folder named like an output\n")
    return setup


def chmod(rel: str, mode: int) -> Callable[[Path], None]:
    def setup(root: Path) -> None:
        os.chmod(root / rel, mode)
    return setup


# --- command lines ---------------------------------------------------------------------

EXPORT = ["export", "--variants", "relu", "--dtypes", "fp32", "--d-model", "32", "--out", "{out}"]
PROFILE = ["profile", "--variants", "relu", "--d-model", "32", "--tokens", "64", "--batch-size", "64", "--bins", "64",
           "--out", "{out}"]
QUANTIZE = ["quantize", "--variants", "relu", "--d-model", "32", "--scheme", "w8a8", "--calibrator", "minmax",
            "--calib-tokens", "256", "--eval-tokens", "128", "--out-artifacts", "{exp}", "--out-reports", "{out}"]
BENCH = ["bench", "--variants", "relu", "--d-model", "32", "--runtimes", "torch-cpu", "--schemes", "fp32", "--tokens", "1",
         "--budget-s", "0.001", "--warmup", "1", "--min-repeats", "1", "--no-progress", "--out", "{out}"]
RUN = ["run", "--variants", "relu", "--d-model", "32", "--calib-tokens", "256", "--eval-tokens", "128",
       "--batch-size", "128", "--bins", "64", "--schemes", "fp32,w8a8@minmax", "--runtimes", "none", "--no-sensitivity",
       "--out", "{out}", "--export", "{exp}"]
M = "{in}/m"
CAPTURE = ["model", "capture", M, "--out", "{new}", "--max-tokens", "64", "--seq-len", "16"]
EXPORT_PLAN = ["export", "--model", M, "--plan", "{in}/plan.toml", "--calib-tokens", "64", "--eval-tokens", "64"]
PLAN = ["plan", "--model", M, "--calib-tokens", "64", "--eval-tokens", "64", "--no-progress", "--out", "{out}"]
QUANTIZE_PLAN = ["quantize", "--model", M, "--plan", "{in}/plan.toml", "--calib-tokens", "64", "--eval-tokens", "64",
                 "--no-progress", "--out-artifacts", "{exp}", "--out-reports", "{out}"]


def plan_file(n_layers: int = 2, recipe: str = "w8a8@search") -> str:
    """plan.toml for the hand-written 2-layer llama of `model()` (or, with another layer count, a foreign one)."""
    rows = "".join(f'[[layers]]\nindex = {i}\nrecipe = "{recipe}"\n' for i in range(min(n_layers, 2)))
    return (f'version = 1\n[model]\nmodel_type = "llama"\nvariant = "swiglu"\nn_layers = {n_layers}\n'
            f"d_model = 32\nd_ff = 64\n{rows}")


EVAL_CAPTURED = ["model", "eval", M, "--calib-captured", "{in}/cal", "--eval-captured", "{in}/ev", "--schemes", "w8a8",
                 "--out", "{out}"]


@dataclass(frozen=True)
class Case:
    id: str
    argv: list[str]
    names: tuple[str, ...]  # the one stderr line must contain one of these (case-insensitive)
    setup: Callable[[Path], None] | None = None
    subprocess: bool = False  # may block in a syscall or a C loop: a subprocess with a timeout
    skip: str | None = None


def C(id, argv, names, setup=None, subprocess=False, skip=None) -> Case:
    return Case(id, list(argv), (names,) if isinstance(names, str) else tuple(names), setup, subprocess, skip)


ROOT_SKIP = "runs as root: permissions do not stop root" if IS_ROOT else None

CASES = [
    # --- bad values: names, sizes, counts, budgets -----------------------------------------
    C("export-unknown-variant", EXPORT + ["--variants", "relu,swigl"], "swigl"),
    C("export-unknown-dtype", EXPORT + ["--dtypes", "fp8"], "fp8"),
    C("export-opset-too-old", EXPORT + ["--opset", "11"], "opset"),
    C("export-d-model-zero", EXPORT + ["--d-model", "0"], "d-model"),
    C("export-d-model-negative", EXPORT + ["--d-model", "-5"], "d-model"),
    C("export-d-model-nan", EXPORT + ["--d-model", "nan"], "d-model"),
    C("export-d-model-1e9", EXPORT + ["--d-model", BIG], (BIG, "d_model")),
    C("export-d-ff-1e11", EXPORT + ["--d-ff", "100000000000"], ("d_ff", "100000000000")),
    C("export-multiple-of-1e12", EXPORT + ["--variants", "swiglu", "--multiple-of", "1000000000000"],
      ("d_ff", "multiple")),
    C("export-ffn-dim-multiplier-nan", EXPORT + ["--variants", "swiglu", "--ffn-dim-multiplier", "nan"], "multiplier"),
    C("export-ffn-dim-multiplier-negative", EXPORT + ["--variants", "swiglu", "--ffn-dim-multiplier", "-1"], "multiplier"),
    C("export-ffn-dim-multiplier-1e30", EXPORT + ["--variants", "swiglu", "--ffn-dim-multiplier", "1e30"],
      ("multiplier", "d_ff")),
    C("export-d-ff-and-multiplier", EXPORT + ["--d-ff", "64", "--ffn-dim-multiplier", "1.3"], "exclusive"),
    C("variants-d-model-text", ["variants", "--d-model", "abc"], "abc"),
    C("variants-empty-variants", ["variants", "--variants", ""], "variant"),
    C("variants-unknown-variant", ["variants", "--variants", "relu,bogus"], "bogus"),
    C("profile-d-model-1e9", PROFILE + ["--d-model", BIG], (BIG, "d_model")),
    C("profile-tokens-zero", PROFILE + ["--tokens", "0"], "tokens"),
    C("profile-tokens-negative", PROFILE + ["--tokens", "-1"], "tokens"),
    C("profile-bins-not-multiple-of-4", PROFILE + ["--bins", "6"], "bins"),
    C("profile-batch-size-zero", PROFILE + ["--batch-size", "0"], "batch"),
    C("profile-unknown-source", PROFILE + ["--source", "bogus"], "bogus"),
    C("profile-outlier-channels-beyond-d", PROFILE + ["--source", "llm_like", "--outlier-channels", "100"],
      "outlier"),
    C("profile-outlier-scale-nan", PROFILE + ["--source", "llm_like", "--outlier-scale", "nan"], "outlier"),
    C("quantize-unknown-scheme", QUANTIZE + ["--scheme", "w9a9"], "w9a9"),
    C("quantize-unknown-calibrator", QUANTIZE + ["--calibrator", "bogus"], "bogus"),
    C("quantize-percentile-150", QUANTIZE + ["--calibrator", "percentile:150"], "percentile"),
    C("quantize-smooth-1.5", QUANTIZE + ["--smooth", "1.5"], "smooth"),
    C("quantize-smooth-negative", QUANTIZE + ["--smooth", "-0.1"], "smooth"),
    C("quantize-smooth-nan", QUANTIZE + ["--smooth", "nan"], "smooth"),
    C("quantize-unknown-smooth-site", QUANTIZE + ["--smooth", "0.5", "--smooth-sites", "bogus"], "bogus"),
    C("quantize-smooth-gelu-hidden", QUANTIZE + ["--variants", "gelu", "--smooth", "0.5", "--smooth-sites", "hidden"],
      "gelu"),
    C("quantize-calib-tokens-zero", QUANTIZE + ["--calib-tokens", "0"], "calib-tokens"),
    C("quantize-calib-tokens-1e12", QUANTIZE + ["--calib-tokens", "1000000000000"], ("token", "1000000000000")),
    C("quantize-eval-tokens-1e12", QUANTIZE + ["--eval-tokens", "1000000000000"], ("token", "1000000000000")),
    C("bench-d-model-1e9", BENCH + ["--d-model", BIG], (BIG, "d_model")),
    C("bench-unknown-runtime", BENCH + ["--runtimes", "tpu"], "tpu"),
    C("bench-unknown-scheme", BENCH + ["--schemes", "w9a9"], "w9a9"),
    C("bench-recipe-with-remedies", BENCH + ["--schemes", "w8a8@auto+smooth"], ("w8a8@auto+smooth", "ffnquant run")),
    C("bench-tokens-zero", BENCH + ["--tokens", "0"], "tokens"),
    C("bench-tokens-not-a-number", BENCH + ["--tokens", "1,x"], "tokens"),
    C("bench-budget-zero", BENCH + ["--budget-s", "0"], "budget"),
    C("bench-budget-nan", BENCH + ["--budget-s", "nan"], "budget"),
    C("bench-budget-inf", BENCH + ["--budget-s", "inf"], "budget"),
    C("bench-max-total-inf", BENCH + ["--max-total-s", "inf"], "max"),
    C("bench-warmup-negative", BENCH + ["--warmup", "-1"], "warmup"),
    C("bench-min-repeats-negative", BENCH + ["--min-repeats", "-1"], "repeats"),
    C("run-d-model-1e9", RUN + ["--d-model", BIG], (BIG, "d_model"), subprocess=True),
    C("run-unknown-runtime", RUN + ["--runtimes", "tpu"], "tpu"),
    C("run-tokens-not-a-number", RUN + ["--tokens", "1,x"], "tokens"),
    C("run-budget-nan", RUN + ["--budget-s", "nan"], "budget"),
    C("run-budget-inf", RUN + ["--budget-s", "inf"], "budget"),
    C("run-target-db-nan", RUN + ["--target-db", "nan"], "target"),
    C("run-calib-tokens-1e12", RUN + ["--calib-tokens", "1000000000000"], ("token", "1000000000000")),
    C("run-config-and-tiny", RUN + ["--tiny", "--config", "{in}/run.toml"], ("tiny", "config"),
      setup=config_toml(GOOD_TOML)),
    # --- the recipe grammar (ffnquant.recipe.GRAMMAR) ---------------------------------------
    C("recipe-empty-calibrator", RUN + ["--schemes", "fp32,w8a8@"], "w8a8@"),
    C("recipe-repeated-remedies", RUN + ["--schemes", "fp32,w8a8+smooth+smooth=0.3+rotate+rotate"], ("twice", "repeat")),
    C("recipe-repeated-rotate", RUN + ["--schemes", "fp32,w8a8+rotate+rotate"], ("twice", "repeat")),
    C("recipe-unknown-remedy", RUN + ["--schemes", "fp32,w8a8+bogus"], "bogus"),
    C("recipe-smooth-above-1", RUN + ["--schemes", "fp32,w8a8+smooth=1.5"], "smooth"),
    C("recipe-smooth-negative", RUN + ["--schemes", "fp32,w8a8+smooth=-0.1"], "smooth"),
    C("recipe-smooth-nan", RUN + ["--schemes", "fp32,w8a8+smooth=nan"], "smooth"),
    C("recipe-smooth-not-a-number", RUN + ["--schemes", "fp32,w8a8+smooth=half"], "half"),
    C("recipe-remedy-on-float", RUN + ["--schemes", "fp32,fp16+smooth"], "fp16"),
    C("recipe-calibrator-on-dynamic", RUN + ["--schemes", "fp32,w8a8-dynamic@mse"], "w8a8-dynamic"),
    C("recipe-unknown-calibrator", RUN + ["--schemes", "fp32,w8a8@bogus"], "bogus"),
    C("recipe-unknown-scheme", RUN + ["--schemes", "fp32,w9a9"], "w9a9"),
    C("recipe-no-scheme", RUN + ["--schemes", "fp32,@auto"], "@auto"),
    C("recipe-empty-list", RUN + ["--schemes", ","], "scheme"),
    C("recipe-duplicate", RUN + ["--schemes", "fp32,w8a8,w8a8"], ("twice", "duplicate")),
    C("baseline-quantized", RUN + ["--schemes", "fp32,w8a8", "--baseline", "w8a8"], "baseline"),
    C("baseline-with-calibrator", RUN + ["--baseline", "fp32@minmax"], ("baseline", "fp32@minmax")),
    C("baseline-not-in-schemes", RUN + ["--baseline", "fp16"], "baseline"),
    # --- token files (profile/quantize/run --source) ----------------------------------------
    C("tokens-float128", PROFILE + ["--source", "{in}/x.npy"], ("float128", "longdouble"), setup=float128_npy),
    C("tokens-complex", PROFILE + ["--source", "{in}/x.npy"], "complex",
      setup=npy("x.npy", lambda: rows().astype(np.complex64))),
    C("tokens-int", PROFILE + ["--source", "{in}/x.npy"], "int32",
      setup=npy("x.npy", lambda: np.ones((128, 32), np.int32))),
    C("tokens-bool", PROFILE + ["--source", "{in}/x.npy"], "bool",
      setup=npy("x.npy", lambda: np.ones((128, 32), bool))),
    C("tokens-object", PROFILE + ["--source", "{in}/x.npy"], ("object", "pickle"),
      setup=npy("x.npy", lambda: np.array([[{"a": 1}] * 32] * 4, dtype=object), allow_pickle=True)),
    C("tokens-empty", PROFILE + ["--source", "{in}/x.npy"], "empty",
      setup=npy("x.npy", lambda: np.zeros((0, 32), np.float32))),
    C("tokens-nan", PROFILE + ["--source", "{in}/x.npy"], "nan",
      setup=npy("x.npy", lambda: np.where(np.arange(32) == 7, np.nan, rows()).astype(np.float32))),
    C("tokens-inf", PROFILE + ["--source", "{in}/x.npy"], "inf",
      setup=npy("x.npy", lambda: np.where(np.arange(32) == 7, np.inf, rows()).astype(np.float32))),
    C("tokens-wrong-last-dim", PROFILE + ["--source", "{in}/x.npy"], ("16", "last dim"),
      setup=npy("x.npy", lambda: rows(128, 16))),
    C("tokens-1d", PROFILE + ["--source", "{in}/x.npy"], "shape",
      setup=npy("x.npy", lambda: rows().reshape(-1))),
    C("tokens-4d", PROFILE + ["--source", "{in}/x.npy"], "shape",
      setup=npy("x.npy", lambda: rows().reshape(2, 2, 32, 32))),
    C("tokens-truncated", PROFILE + ["--source", "{in}/x.npy"], "x.npy", setup=truncated_npy),
    C("tokens-corrupt", PROFILE + ["--source", "{in}/x.npy"], "x.npy", setup=write("x.npy", os.urandom(300))),
    C("tokens-a-directory", PROFILE + ["--source", "{in}/x.npy"], "x.npy", setup=folder("x.npy")),
    C("tokens-missing", PROFILE + ["--source", "{in}/missing.npy"], "missing.npy"),
    C("tokens-unsupported-extension", PROFILE + ["--source", "{in}/x.txt"], (".txt", "extension"),
      setup=write("x.txt", "1 2 3\n")),
    C("tokens-fifo", PROFILE + ["--source", "{in}/x.npy"], ("regular", "fifo", "pipe"), setup=fifo("x.npy"),
      subprocess=True),
    C("tokens-safetensors-two-tensors", PROFILE + ["--source", "{in}/x.safetensors"], ("tensors", "name"),
      setup=two_tensor_safetensors),
    C("tokens-safetensors-int", PROFILE + ["--source", "{in}/x.safetensors"], ("int32", "i32", "dtype"),
      setup=int_safetensors),
    C("tokens-safetensors-corrupt", PROFILE + ["--source", "{in}/x.safetensors"], "x.safetensors",
      setup=write("x.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")),
    C("tokens-safetensors-unknown-name", PROFILE + ["--source", "{in}/x.safetensors::nope"], "nope",
      setup=lambda r: _save_safetensors(r / "in" / "x.safetensors", {"acts": rows()})),
    C("tokens-npy-with-tensor-name", PROFILE + ["--source", "{in}/x.npy::acts"], ("npy", "name"),
      setup=npy("x.npy", rows)),
    C("tokens-file-prefix-without-path", PROFILE + ["--source", "file:"], "file:"),
    C("tokens-quantize-wrong-dim", QUANTIZE + ["--source", "{in}/x.npy"], ("16", "last dim"),
      setup=npy("x.npy", lambda: rows(512, 16))),
    C("tokens-quantize-too-few", QUANTIZE + ["--source", "{in}/x.npy"], ("tokens", "x.npy"),
      setup=npy("x.npy", lambda: rows(8, 32))),
    C("tokens-run-big-endian-nan", RUN + ["--source", "{in}/x.npy"], "nan",
      setup=npy("x.npy", lambda: np.where(np.arange(32) == 7, np.nan, rows(512)).astype(">f4"))),
    # --- config files (run --config) --------------------------------------------------------
    C("config-unknown-key", ["run", "--config", "{in}/run.toml"], "colour", setup=config_toml(GOOD_TOML + "colour = 3\n")),
    C("config-wrong-type", ["run", "--config", "{in}/run.toml"], "d_model",
      setup=config_toml(GOOD_TOML.replace("d_model = 32", 'd_model = "big"'))),
    C("config-bool-for-int", ["run", "--config", "{in}/run.toml"], "bins",
      setup=config_toml(GOOD_TOML.replace("bins = 64", "bins = true"))),
    C("config-d-model-1e9", ["run", "--config", "{in}/run.toml"], (BIG, "d_model"),
      setup=config_toml(GOOD_TOML.replace("d_model = 32", f"d_model = {BIG}")), subprocess=True),
    C("config-invalid-toml", ["run", "--config", "{in}/run.toml"], "toml", setup=config_toml("d_model = = 3\n[[[")),
    C("config-not-utf8", ["run", "--config", "{in}/run.toml"], "run.toml", setup=config_toml(b"\xff\xfe\x00bad")),
    C("config-bad-recipe", ["run", "--config", "{in}/run.toml"], "w8a8@",
      setup=config_toml(GOOD_TOML.replace('"w8a8@minmax"', '"w8a8@"'))),
    C("config-version-99", ["run", "--config", "{in}/run.toml"], "version", setup=config_toml(GOOD_TOML + "version = 99\n")),
    C("config-budget-inf", ["run", "--config", "{in}/run.toml"], "budget", setup=config_toml(GOOD_TOML + "budget_s = inf\n")),
    C("config-tokens-zero", ["run", "--config", "{in}/run.toml"], "tokens", setup=config_toml(GOOD_TOML + "tokens = [0]\n")),
    C("config-variants-a-number", ["run", "--config", "{in}/run.toml"], "variants",
      setup=config_toml(GOOD_TOML.replace('variants = ["relu"]', "variants = 3"))),
    C("config-text-without-model", ["run", "--config", "{in}/run.toml"], "model",
      setup=config_toml(GOOD_TOML + 'text = "calib.txt"\n')),
    C("config-nested-table", ["run", "--config", "{in}/run.toml"], "extra", setup=config_toml(GOOD_TOML + "[extra]\nx = 1\n")),
    C("config-missing", ["run", "--config", "{in}/missing.toml"], "missing.toml"),
    C("config-a-directory", ["run", "--config", "{in}/run.toml"], "run.toml", setup=folder("run.toml")),
    C("config-fifo", ["run", "--config", "{in}/run.toml"], ("regular", "fifo", "pipe"), setup=fifo("run.toml"),
      subprocess=True),
    C("config-unreadable", ["run", "--config", "{in}/run.toml"], "run.toml",
      setup=chain(config_toml(GOOD_TOML), chmod("in/run.toml", 0)), skip=ROOT_SKIP),
    # --- model folders ------------------------------------------------------------------------
    C("model-folder-missing", ["model", "inspect", "{in}/nothing"], "nothing"),
    C("model-folder-is-a-file", ["model", "inspect", "{in}/file"], "file", setup=write("file", "x")),
    C("model-config-missing", ["model", "inspect", M], "config.json",
      setup=chain(model(), lambda r: (r / "in/m/config.json").unlink())),
    C("model-config-not-json", ["model", "inspect", M], "config.json", setup=chain(model(), model_file("config.json", "{oops"))),
    C("model-config-a-list", ["model", "inspect", M], "config.json", setup=chain(model(), model_file("config.json", "[1, 2]"))),
    C("model-config-a-directory", ["model", "inspect", M], "config.json",
      setup=chain(model(), model_file("config.json", kind="dir"))),
    C("model-config-fifo", ["model", "inspect", M], ("regular", "fifo", "pipe"),
      setup=chain(model(), model_file("config.json", kind="fifo")), subprocess=True),
    C("model-config-unreadable", ["model", "inspect", M], "config.json",
      setup=chain(model(), chmod("in/m/config.json", 0)), skip=ROOT_SKIP),
    C("model-unknown-model-type", ["model", "inspect", M], "bogus", setup=model(model_type="bogus")),
    C("model-hidden-size-mismatch", ["model", "inspect", M], ("48", "hidden_size", "shape"), setup=model(hidden_size=48)),
    C("model-hidden-size-1e9", ["model", "inspect", M], (BIG, "hidden_size", "shape"), setup=model(hidden_size=int(BIG))),
    C("model-zero-layers", ["model", "inspect", M], ("num_hidden_layers", "layers"), setup=model(num_hidden_layers=0)),
    C("model-unknown-activation", ["model", "inspect", M], "bogus_act", setup=model(hidden_act="bogus_act")),
    C("model-layers-out-of-range", ["model", "inspect", M, "--layers", "5"], "5", setup=model()),
    C("model-layers-garbage", ["model", "inspect", M, "--layers", "x-y"], "x-y", setup=model()),
    C("model-no-weights", ["model", "inspect", M], ("weights", "safetensors"),
      setup=chain(model(), lambda r: (r / "in/m/model.safetensors").unlink())),
    C("model-safetensors-corrupt", ["model", "inspect", M], "model.safetensors",
      setup=chain(model(), model_file("model.safetensors", b"\xff" * 64))),
    C("model-safetensors-fifo", ["model", "inspect", M], ("regular", "fifo", "pipe"),
      setup=chain(model(), model_file("model.safetensors", kind="fifo")), subprocess=True),
    C("model-safetensors-a-directory", ["model", "inspect", M], "model.safetensors",
      setup=chain(model(), model_file("model.safetensors", kind="dir"))),
    C("model-shard-outside-folder", ["model", "inspect", M], "../elsewhere/model.safetensors",
      setup=chain(model(), sharded_index("../elsewhere/model.safetensors"))),
    C("model-shard-absolute-path", ["model", "inspect", M], "elsewhere/model.safetensors",
      setup=chain(model(), sharded_index("{outside}/model.safetensors"))),
    C("model-shard-missing", ["model", "inspect", M], "model-00001-of-00002.safetensors",
      setup=chain(model(), sharded_index("model-00001-of-00002.safetensors", place_outside=False))),
    C("model-index-not-json", ["model", "inspect", M], "index",
      setup=chain(model(), model_file("model.safetensors.index.json", "{oops"))),
    C("model-index-weight-map-a-list", ["model", "inspect", M], ("index", "weight_map"),
      setup=chain(model(), model_file("model.safetensors.index.json", '{"weight_map": []}'))),
    C("model-pickle-not-allowed", ["model", "inspect", M], ("pickle", "allow-pickle"),
      setup=chain(model(), pickled(lambda: {"w": torch.zeros(2)}))),
    C("model-pickle-non-tensor-object", ["model", "inspect", M, "--allow-pickle"], ("weights-only", "weights_only", "object"),
      setup=chain(model(), pickled(lambda: {"model.layers.0.mlp.up_proj.weight": _NotATensor()}))),
    C("model-pickle-malicious-reduce", ["model", "inspect", M, "--allow-pickle"], ("weights-only", "weights_only", "object"),
      setup=chain(model(), pickled(lambda: {"x": _Malicious()}))),
    C("model-pickle-a-list", ["model", "inspect", M, "--allow-pickle"], "state dict",
      setup=chain(model(), pickled(lambda: [torch.zeros(2)]))),
    C("model-pickle-corrupt", ["model", "inspect", M, "--allow-pickle"], "pytorch_model.bin",
      setup=chain(model(), pickled(lambda: None), model_file("pytorch_model.bin", b"\x80\x04not a pickle"))),
    C("model-eval-nan-weights", EVAL_CAPTURED, ("nan", "infinite"),
      setup=chain(model(), captured(), lambda r: _nan_weight(r / "in/m"))),
    C("model-eval-captured-wrong-dim", EVAL_CAPTURED, ("16", "last dim", "d_model"), setup=chain(model(), captured(d=16))),
    C("model-eval-captured-nan", EVAL_CAPTURED, "nan", setup=chain(model(), captured(nan=True))),
    C("model-eval-captured-missing-layer", EVAL_CAPTURED, "l1", setup=chain(model(), captured(layers=("L0",)))),
    C("model-eval-unknown-scheme", EVAL_CAPTURED + ["--schemes", "w9a9"], "w9a9", setup=chain(model(), captured())),
    C("model-eval-unknown-calibrator", EVAL_CAPTURED + ["--calibrator", "bogus"], "bogus",
      setup=chain(model(), captured())),
    C("model-eval-empty-schemes", EVAL_CAPTURED + ["--schemes", ","], "scheme", setup=chain(model(), captured())),
    C("model-eval-only-calib-captured", ["model", "eval", M, "--calib-captured", "{in}/cal", "--out", "{out}"],
      "captured", setup=chain(model(), captured())),
    C("model-capture-tokenizer-beyond-vocab",
      CAPTURE, ("vocab",), setup=tokenized_model(vocab_size=16)),
    C("model-capture-text-missing", CAPTURE + ["--text", "{in}/missing.txt"], "missing.txt", setup=tokenized_model(96)),
    C("model-capture-text-empty", CAPTURE + ["--text", "{in}/t.txt"], ("token", "empty", "t.txt"),
      setup=chain(tokenized_model(96), write("t.txt", ""))),
    C("model-capture-text-binary", CAPTURE + ["--text", "{in}/t.txt"], ("t.txt", "utf-8", "text"),
      setup=chain(tokenized_model(96), write("t.txt", b"\xff\xfe\x00\x01" * 64))),
    C("model-capture-text-a-directory", CAPTURE + ["--text", "{in}/t.txt"], "t.txt",
      setup=chain(tokenized_model(96), folder("t.txt"))),
    C("model-capture-text-fifo", CAPTURE + ["--text", "{in}/t.txt"], ("regular", "fifo", "pipe"),
      setup=chain(tokenized_model(96), fifo("t.txt")), subprocess=True),
    # model folders checked against their config.json before a model is built (heads, shapes, dtypes, values)
    C("model-capture-more-kv-heads-than-heads", CAPTURE, ("num_key_value_heads", "8"),
      setup=tokenized_model_with(num_key_value_heads=8)),
    C("model-capture-kv-heads-not-dividing", CAPTURE, ("num_key_value_heads", "3"),
      setup=tokenized_model_with(num_key_value_heads=3)),
    C("model-capture-heads-not-dividing-width", CAPTURE, ("num_attention_heads", "5"),
      setup=tokenized_model_with(num_attention_heads=5, num_key_value_heads=1)),
    C("model-capture-head-dim-zero", CAPTURE, "head_dim", setup=tokenized_model_with(head_dim=0)),
    C("model-capture-embedding-inf", CAPTURE, ("embed_tokens", "inf"),
      setup=tokenized_model_with(embedding=lambda: _embedding_with(float("inf")))),
    C("model-capture-embedding-nan", CAPTURE, ("embed_tokens", "nan"),
      setup=tokenized_model_with(embedding=lambda: _embedding_with(float("nan")))),
    C("model-capture-embedding-wrong-shape", CAPTURE, ("embed_tokens", "vocab_size"),
      setup=tokenized_model_with(embedding=lambda: torch.zeros(90, 32))),
    C("model-capture-embedding-int8", CAPTURE, ("embed_tokens", "I8", "dtype"),
      setup=tokenized_model_with(embedding=lambda: torch.zeros(96, 32, dtype=torch.int8))),
    C("model-inspect-q-proj-wrong-shape", ["model", "inspect", M], ("q_proj", "[16, 32]", "[32, 32]"),
      setup=chain(tokenized_model_with(), lambda r: _add_tensor(r / "in/m", "model.layers.0.self_attn.q_proj.weight",
                                                                torch.zeros(16, 32)))),
    C("model-capture-seq-len-1", CAPTURE + ["--seq-len", "1"], "seq", setup=tokenized_model(96)),
    C("profile-model-fifo-safetensors", PROFILE + ["--model", M, "--captured", "{in}/cal"], ("regular", "fifo", "pipe"),
      setup=chain(model(), captured(), model_file("model.safetensors", kind="fifo")), subprocess=True),
    # --- plans: the plan command's input, and plan files given to quantize / export -----------
    C("plan-bad-target", PLAN + ["--target", "ppl<1%"], "ppl<1%", setup=model()),
    C("plan-unknown-objective", PLAN + ["--objective", "speed"], "speed", setup=model()),
    C("plan-decode-tokens-negative", PLAN + ["--decode-tokens", "-1"], "decode tokens", setup=model()),
    C("plan-unknown-candidate", PLAN + ["--candidates", "w8a8,w9a9"], "w9a9", setup=model()),
    C("plan-unknown-format", PLAN + ["--format", "gguf"], ("gguf", "onnx, compressed-tensors"), setup=model()),
    C("plan-missing-model", PLAN, ("m", "config.json", "exist")),
    C("plan-encoder-model", PLAN, ("causal lm", "bert"),
      setup=model(model_type="bert", intermediate_size=64)),
    C("plan-out-is-a-file", PLAN + ["--out", "{out}/keep.txt"], "keep.txt", setup=model()),
    # --out holds a user's files (keep.txt, an earlier run's report.json...): never replaced, --force or not
    C("plan-out-holds-other-files", PLAN, ("exists and is not empty", "--force"), setup=tokenized_model(96)),
    C("plan-out-force-over-other-files", PLAN + ["--force"], ("holds no plan.json of an earlier ffnquant command",),
      setup=tokenized_model(96)),
    C("plan-text-lone-surrogate", [a if a != "{out}" else "{new}" for a in PLAN] + ["--text", "{in}/t.jsonl"],
      ("t.jsonl' line 2 holds invalid unicode",),
      setup=chain(tokenized_model(96), write("t.jsonl", '{"text": "fine"}\n{"text": "a \\ud800 b"}\n'))),
    C("plan-eval-text-3-tokens", [a if a != "{out}" else "{new}" for a in PLAN] + ["--eval-text", "{in}/e.txt"],
      ("not verified:", "cannot resolve ppl+1%"), setup=chain(tokenized_model(96), write("e.txt", "a b c"))),
    C("export-plan-opset", EXPORT_PLAN + ["--out", "{new}", "--opset", "5"], ("--opset is an option of ffn variant",),
      setup=chain(model(), write("plan.toml", plan_file()))),
    C("export-plan-dtypes", EXPORT_PLAN + ["--out", "{new}", "--dtypes", "fp64"], ("--dtypes is an option of ffn",),
      setup=chain(model(), write("plan.toml", plan_file()))),
    C("quantize-plan-missing-file", QUANTIZE_PLAN, "plan.toml", setup=model()),
    C("quantize-plan-not-toml", QUANTIZE_PLAN, ("toml",), setup=chain(model(), write("plan.toml", "[model"))),
    C("quantize-plan-foreign-model", QUANTIZE_PLAN, ("another model", "n_layers"),
      setup=chain(model(), write("plan.toml", plan_file(n_layers=7)))),
    C("quantize-plan-unknown-recipe", QUANTIZE_PLAN, "w9a9", setup=chain(model(), write("plan.toml", plan_file(recipe="w9a9")))),
    C("quantize-plan-without-model", [a for a in QUANTIZE_PLAN if a not in ("--model", M)], "--model",
      setup=write("plan.toml", plan_file())),
    C("quantize-plan-and-scheme", QUANTIZE_PLAN + ["--scheme", "w8a8"], "--scheme",
      setup=chain(model(), write("plan.toml", plan_file()))),
    # plan files validated as data before any work: one line naming the entry (hand-edited plan.toml)
    C("plan-file-index-a-list", QUANTIZE_PLAN, ("entry 1", "index"),
      setup=chain(model(), write("plan.toml", plan_file().replace("index = 0", "index = [0]")))),
    C("plan-file-index-text", EXPORT_PLAN + ["--out", "{new}"], ("entry 1", "abc"),
      setup=chain(model(), write("plan.toml", plan_file().replace("index = 0", 'index = "abc"')))),
    C("plan-file-index-bool", QUANTIZE_PLAN, ("entry 2", "true"),
      setup=chain(model(), write("plan.toml", plan_file().replace("index = 1", "index = true")))),
    C("plan-file-index-float", QUANTIZE_PLAN, ("entry 2", "1.0"),
      setup=chain(model(), write("plan.toml", plan_file().replace("index = 1", "index = 1.0")))),
    C("plan-file-index-out-of-range", QUANTIZE_PLAN, ("entry 2", "0..1"),
      setup=chain(model(), write("plan.toml", plan_file().replace("index = 1", "index = 9")))),
    C("plan-file-index-twice", QUANTIZE_PLAN, ("layer 0", "twice"),
      setup=chain(model(), write("plan.toml", plan_file().replace("index = 1", "index = 0")))),
    C("plan-file-recipe-a-number", QUANTIZE_PLAN, ("layer 0", "recipe"),
      setup=chain(model(), write("plan.toml", plan_file().replace('recipe = "w8a8@search"', "recipe = 8", 1)))),
    C("plan-file-entry-without-recipe", QUANTIZE_PLAN, ("entry 1", "recipe"),
      setup=chain(model(), write("plan.toml", plan_file().replace('recipe = "w8a8@search"', 'colour = "red"', 1)))),
    C("plan-file-summary-a-list", EXPORT_PLAN + ["--out", "{new}"], "summary",
      setup=chain(model(), write("plan.toml", plan_file().replace("[model]", 'summary = ["x"]\n[model]')))),
    C("plan-file-layers-a-table", QUANTIZE_PLAN, "layers",
      setup=chain(model(), write("plan.toml", plan_file().split("[[layers]]")[0] + "[layers]\nindex = 0\n"))),
    C("plan-file-version-true", QUANTIZE_PLAN, "version",
      setup=chain(model(), write("plan.toml", plan_file().replace("version = 1", "version = true")))),
    C("plan-file-n-layers-text", QUANTIZE_PLAN, ("n_layers", "abc"),
      setup=chain(model(), write("plan.toml", plan_file().replace("n_layers = 2", 'n_layers = "abc"')))),
    C("plan-file-bad-target", EXPORT_PLAN + ["--out", "{new}"], ("target", "ppl<1%"),
      setup=chain(model(), write("plan.toml", plan_file().replace("[model]", 'target = "ppl<1%"\n[model]')))),
    C("plan-file-objective-a-table", QUANTIZE_PLAN, "objective",
      setup=chain(model(), write("plan.toml", plan_file().replace("[model]", 'objective = {kind = 3}\n[model]')))),
    C("export-plan-without-model", ["export", "--plan", "{in}/plan.toml", "--out", "{exp}"], "--model",
      setup=write("plan.toml", plan_file())),
    # the run's own inputs are never an output, --force or not
    C("export-out-is-the-model", EXPORT_PLAN + ["--out", M, "--force"], "would replace it",
      setup=chain(model(), write("plan.toml", plan_file()))),
    C("export-out-holds-the-plan", EXPORT_PLAN + ["--out", "{in}", "--force"], "would replace it",
      setup=chain(model(), write("plan.toml", plan_file()))),
    # --force replaces only what an earlier export listed in its ffnquant-deploy.json (issue 27)
    C("export-force-over-other-files", EXPORT_PLAN + ["--out", "{exp}", "--force"], ("relu_d32_ff128", "ffnquant-deploy.json"),
      setup=chain(model(), write("plan.toml", plan_file()))),
    C("export-force-over-a-listing-that-misses-a-file", EXPORT_PLAN + ["--out", "{in}/dep", "--force"], "notes.md",
      setup=chain(model(), write("plan.toml", plan_file()), write("dep/model.onnx", b"onnx"), write("dep/notes.md", "mine"),
                  write("dep/ffnquant-deploy.json", '{"files": ["model.onnx", "ffnquant-deploy.json"]}'))),
    C("export-format-empty", EXPORT_PLAN + ["--format", "", "--out", "{new}"], ("format", "onnx"),
      setup=chain(model(), write("plan.toml", plan_file()))),
    C("plan-out-empty", [a for a in PLAN if a not in ("--out", "{out}")] + ["--out", ""], ("output", "empty"),
      setup=model()),
    # --- output folders -----------------------------------------------------------------------
    C("export-out-is-a-file", EXPORT + ["--out", "{out}/keep.txt"], "keep.txt"),
    C("export-out-below-a-file", EXPORT + ["--out", "{out}/keep.txt/sub"], "keep.txt"),
    C("profile-out-is-a-file", PROFILE + ["--out", "{out}/keep.txt"], "keep.txt"),
    C("quantize-artifacts-out-is-a-file", QUANTIZE + ["--out-artifacts", "{out}/keep.txt"], "keep.txt"),
    C("quantize-reports-out-is-a-file", QUANTIZE + ["--out-reports", "{out}/keep.txt"], "keep.txt"),
    C("bench-out-is-a-file", BENCH + ["--out", "{out}/keep.txt"], "keep.txt"),
    C("run-out-is-a-file", RUN + ["--out", "{out}/keep.txt"], "keep.txt"),
    C("run-export-is-a-file", RUN + ["--export", "{out}/keep.txt"], "keep.txt"),
    C("model-capture-out-is-a-file", ["model", "capture", M, "--out", "{out}/keep.txt"], "keep.txt", setup=model()),
    C("model-eval-out-is-a-file", EVAL_CAPTURED + ["--out", "{out}/keep.txt"], "keep.txt", setup=chain(model(), captured())),
    C("bench-name-escapes", BENCH + ["--name", "../escaped"], "escaped"),
    C("bench-name-empty", BENCH + ["--name", ""], "name"),
    C("bench-name-hidden", BENCH + ["--name", ".hidden"], "hidden"),
    C("bench-name-subfolder", BENCH + ["--name", "a/b"], "a/b"),
    C("bench-name-too-long", BENCH + ["--name", "a" * 300], "name"),
    C("bench-target-is-a-dir", BENCH, "latency.json", setup=replace_with_dir("out/latency.json")),
    C("export-target-is-a-dir", EXPORT + ["--out", "{exp}"], "relu_d32_ff128.fp32.onnx",
      setup=replace_with_dir("exp/relu_d32_ff128.fp32.onnx")),
    C("profile-target-is-a-dir", PROFILE, "ranges.json", setup=replace_with_dir("out/ranges.json")),
    C("quantize-target-is-a-dir", QUANTIZE, "relu_d32_ff128.w8a8-minmax.onnx",
      setup=replace_with_dir("exp/relu_d32_ff128.w8a8-minmax.onnx")),
    C("run-target-is-a-dir", RUN + ["--no-onnx"], "report.json", setup=replace_with_dir("out/report.json")),
    C("model-eval-target-is-a-dir", EVAL_CAPTURED, "model-m.json",
      setup=chain(model(), captured(), replace_with_dir("out/model-m.json"))),
    C("bench-out-read-only", BENCH, "out", setup=chmod("out", 0o555), skip=ROOT_SKIP),
]


def _add_tensor(folder: Path, name: str, value: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    state[name] = value
    save_file(state, str(folder / "model.safetensors"))


def _nan_weight(folder: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(state, str(folder / "model.safetensors"))


def test_table_is_large_and_ids_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), [i for i in ids if ids.count(i) > 1]
    assert len(CASES) >= 60
    commands = {c.argv[0] if c.argv[0] != "model" else f"model {c.argv[1]}" for c in CASES}
    assert {"export", "profile", "quantize", "plan", "bench", "run", "variants", "model inspect", "model eval",
            "model capture"} <= commands


# --- running a case ------------------------------------------------------------------------

@dataclass
class Outcome:
    rc: int | None
    stderr: str
    crashed: str | None = None  # "traceback: TypeName: message" when an exception escaped main()
    seconds: float = 0.0


class _Watchdog(BaseException):
    """Raised by SIGALRM in the main thread when an in-process case runs too long."""


@contextlib.contextmanager
def watchdog(seconds: float):
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise _Watchdog(f"still running after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def log_handlers_follow_stderr():
    """Point the plain stderr log handlers (transformers' among them) at the current sys.stderr for the call.

    A handler keeps the stream it was made with: made during an earlier test it would write into that
    test's closed capture ("--- Logging error ---" tracebacks), not to what this case's user would see.
    """
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    saved = [(h, h.stream, vars(h).get("flush")) for lg in loggers for h in lg.handlers
             if type(h) is logging.StreamHandler and h.stream is not sys.stdout]
    for h, _, flush in saved:
        h.stream = sys.stderr
        if flush is not None:  # transformers binds the handler's flush to the stderr of its import
            h.flush = sys.stderr.flush
    try:
        yield
    finally:
        for h, stream, flush in saved:
            h.stream = stream
            if flush is not None:
                h.flush = flush


def run_in_process(argv: list[str], capsys) -> Outcome:
    capsys.readouterr()
    start = time.perf_counter()
    crashed = None
    rc = None
    try:
        with watchdog(IN_PROCESS_TIMEOUT_S), log_handlers_follow_stderr():
            rc = main(argv)
    except _Watchdog as exc:
        crashed = f"hang: {exc}"
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    except BaseException as exc:  # noqa: BLE001 - the case's finding
        crashed = f"traceback: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return Outcome(rc, capsys.readouterr().err, crashed, time.perf_counter() - start)


def run_subprocess(argv: list[str], cwd: Path, timeout: float = SUBPROCESS_TIMEOUT_S) -> Outcome:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ffnquant", *argv], cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return Outcome(None, err, f"hang: no answer within {timeout:g} s", time.perf_counter() - start)
    return Outcome(proc.returncode, err, None, time.perf_counter() - start)


def prepare(case: Case, root: Path) -> tuple[list[str], dict]:
    """Lay out `root` for `case`; returns the argv and the snapshot taken before the command runs."""
    if case.skip:
        pytest.skip(case.skip)
    places = make_layout(root)
    if case.setup is not None:
        case.setup(root)
    argv = [a.format(**places) for a in case.argv]
    return argv, snapshot(root)


def check_refusal(case: Case, outcome: Outcome, root: Path, before: dict) -> None:
    after = snapshot(root)
    assert outcome.crashed is None, f"{case.id}: {outcome.crashed}\nstderr:\n{outcome.stderr[-3000:]}"
    assert "Traceback" not in outcome.stderr, f"{case.id}: traceback on stderr:\n{outcome.stderr[-3000:]}"
    assert outcome.rc == 2, f"{case.id}: exit {outcome.rc}, expected 2\nstderr:\n{outcome.stderr[-3000:]}"
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"{case.id}: {len(lines)} lines on stderr, expected one:\n{outcome.stderr}"
    line = lines[0].lower()
    assert any(n.lower() in line for n in case.names), f"{case.id}: the message names none of {case.names}: {lines[0]}"
    changes = diff(before, after)
    assert not changes, f"{case.id}: the refusal changed the folders: {changes}"


# Subprocess cases are started together when the first case runs (two at a time), so their
# interpreter start-ups overlap the in-process cases; each test then waits for its own.

SUBPROCESS_CASES = [c for c in CASES if c.subprocess]


@pytest.fixture(scope="module")
def background(request, tmp_path_factory):
    wanted = {item.callspec.id for item in request.session.items
              if getattr(item, "callspec", None) is not None and item.originalname == "test_bad_input_is_refused"}
    jobs = {}
    pool = ThreadPoolExecutor(max_workers=2)
    for case in SUBPROCESS_CASES:
        if case.id not in wanted or case.skip:
            continue
        root = tmp_path_factory.mktemp(case.id)
        argv, before = prepare(case, root)
        jobs[case.id] = (root, before, pool.submit(run_subprocess, argv, root))
    yield jobs
    pool.shutdown(wait=True)


@pytest.mark.xdist_group("fuzz-cli-background")  # one worker starts and waits for the background cases
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused(case, tmp_path, capsys, monkeypatch, background):
    if case.subprocess:
        if case.skip:
            pytest.skip(case.skip)
        root, before, future = background[case.id]
        outcome = future.result()
    else:
        root = tmp_path
        monkeypatch.chdir(root)  # a stray default output folder (reports/, export/) would show in the snapshot
        argv, before = prepare(case, root)
        outcome = run_in_process(argv, capsys)
    check_refusal(case, outcome, root, before)


# An output name held by an immutable file (chattr +i: not even root can replace it): refused before any
# file moves, so the other outputs of the set are not half-replaced either.

IMMUTABLE_CASES = [
    (C("bench-target-immutable", BENCH, "latency.json"), "out/latency.json"),
    (C("run-target-immutable", RUN + ["--no-onnx"], "report.json"), "out/report.json"),
    (C("model-eval-target-immutable", EVAL_CAPTURED, "model-m.json",
       setup=chain(model(), captured(), write("../out/model-m.json", "earlier\n"))), "out/model-m.json"),
]


def _chattr(flag: str, path: Path) -> bool:
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.parametrize("case, immutable", IMMUTABLE_CASES, ids=[c.id for c, _ in IMMUTABLE_CASES])
def test_immutable_target_is_refused(case, immutable, tmp_path, capsys, monkeypatch):
    probe = tmp_path / "probe"
    probe.write_text("x")
    if not _chattr("+i", probe):
        pytest.skip("chattr +i is not available here (needs CAP_LINUX_IMMUTABLE on ext2/3/4, xfs, btrfs)")
    _chattr("-i", probe)
    probe.unlink()
    monkeypatch.chdir(tmp_path)
    argv, _ = prepare(case, tmp_path)
    target = tmp_path / immutable
    assert _chattr("+i", target)
    try:
        before = snapshot(tmp_path)
        outcome = run_in_process(argv, capsys)
        check_refusal(case, outcome, tmp_path, before)
    finally:
        _chattr("-i", target)


# --- successes that must keep earlier files -------------------------------------------------

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _stale_temporaries(root: Path) -> None:
    """Leftovers of killed runs (ffnquant's owned names, a dead pid of this host), two days old, and user files
    like them: names without an owner part are never swept, however old (issue 27)."""
    from ffnquant.infra import atomic

    old = time.time() - 2 * 86400
    tag = f"{atomic._HOST}-{_dead_pid()}"
    for rel in (f"out/.latency.json.ffnq-{tag}-k2j3h4g5.tmp", f"out/.report.json.ffnq-{tag}-a1b2c3d4.tmp"):
        (root / rel).write_bytes(b"half a file")
        os.utime(root / rel, (old, old))
    for rel in ("out/notes.tmp", "out/.latency.json.bak", "out/latency.json.orig", "out/.draft.abcdefgh.tmp",
                "out/notes.onnx.partial", "out/.model.rows.tmp"):
        (root / rel).write_bytes(b"a user's file")
        os.utime(root / rel, (old, old))


@dataclass(frozen=True)
class Success:
    id: str
    argv: list[str]
    setup: Callable[[Path], None] | None = None
    kept: tuple[str, ...] = ()  # earlier files that must stay byte-identical (besides every EARLIER file not in replaced)
    replaced: tuple[str, ...] = ()  # earlier files the command legitimately rewrites
    produced: tuple[str, ...] = ()  # files that must exist afterwards
    gone: tuple[str, ...] = ()  # stale temporaries the run must sweep


SUCCESSES = [
    # torch cannot take big-endian arrays; the reader converts them (the crash)
    Success("big-endian-npy-loads", PROFILE + ["--source", "{in}/x.npy"], setup=npy("x.npy", lambda: rows(128, 32, ">f4")),
            replaced=("out/ranges.json",), produced=("out/ranges.json", "out/ranges.md")),
    Success("big-endian-float64-npy-loads", PROFILE + ["--source", "{in}/x.npy"],
            setup=npy("x.npy", lambda: rows(128, 32, ">f8")), replaced=("out/ranges.json",), produced=("out/ranges.json",)),
    Success("float16-safetensors-loads", PROFILE + ["--source", "{in}/x.safetensors"],
            setup=lambda r: _save_safetensors(r / "in" / "x.safetensors", {"acts": rows(128, 32, "<f2")}),
            replaced=("out/ranges.json",), produced=("out/ranges.json",)),
    # a run that writes relu_d32_ff128.w8a8-minmax.onnx must leave relu_d32_ff128.w8a8.onnx (an earlier run's) alone
    Success("run-keeps-earlier-artifact-of-another-name", RUN + ["--schemes", "fp32,w8a8@minmax"],
            replaced=("out/report.json", "out/run.toml", "exp/relu_d32_ff128.fp32.onnx"),
            kept=("exp/relu_d32_ff128.w8a8.onnx",), produced=("out/report.json", "out/run.toml")),
    # a rerun sweeps stale temporaries of ffnquant's own naming, and nothing else
    Success("bench-sweeps-stale-temporaries", BENCH, setup=_stale_temporaries,
            replaced=("out/latency.json", "out/latency.md"),
            kept=("out/notes.tmp", "out/.latency.json.bak", "out/latency.json.orig", "out/.draft.abcdefgh.tmp",
                  "out/notes.onnx.partial", "out/.model.rows.tmp"),
            produced=("out/latency.json", "out/latency.md"),
            gone=("out/.latency.json.ffnq-*.tmp", "out/.report.json.ffnq-*.tmp")),
]


@pytest.mark.parametrize("case", SUCCESSES, ids=[c.id for c in SUCCESSES])
def test_success_keeps_earlier_files(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    places = make_layout(tmp_path)
    if case.setup is not None:
        case.setup(tmp_path)
    before = snapshot(tmp_path)
    outcome = run_in_process([a.format(**places) for a in case.argv], capsys)
    assert outcome.crashed is None, f"{case.id}: {outcome.crashed}\nstderr:\n{outcome.stderr[-3000:]}"
    assert outcome.rc == 0, f"{case.id}: exit {outcome.rc}\nstderr:\n{outcome.stderr[-3000:]}"
    after = snapshot(tmp_path)
    must_keep = (set(EARLIER) - set(case.replaced)) | set(case.kept)
    for rel in sorted(must_keep):
        assert after.get(rel) == before.get(rel), f"{case.id}: {rel} was deleted or changed by a run that did not write it"
    for rel in case.produced:
        assert (tmp_path / rel).is_file(), f"{case.id}: {rel} was not written"
    for rel in case.gone:  # a glob: the owner part of the name is made by the setup
        assert not list(tmp_path.glob(rel)), f"{case.id}: stale temporary {rel} was not swept"
    fresh = sorted(set(leftovers(tmp_path)) - set(before))  # a user's look-alike names were there before
    assert not fresh, f"{case.id}: temporary files left behind: {fresh}"


# --- interruption and write failures mid-write ---------------------------------------------

def _partial_then(exc_fn):
    """A stand-in for onnx.save_model that writes half a file where it was asked to, then fails."""
    def save_model(proto, f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)):
            Path(f).write_bytes(b"\x08\x07half an onnx model")
        raise exc_fn(f)
    return save_model


INTERRUPTIONS = [
    ("quantize-ctrl-c-mid-onnx", QUANTIZE, "onnx.save_model", lambda f: KeyboardInterrupt(), 130, "interrupt"),
    ("export-ctrl-c-mid-onnx", EXPORT + ["--out", "{exp}"], "onnx.save_model", lambda f: KeyboardInterrupt(), 130,
     "interrupt"),
    ("run-ctrl-c-mid-onnx", RUN, "onnx.save_model", lambda f: KeyboardInterrupt(), 130, "interrupt"),
    ("quantize-disk-full-mid-onnx", QUANTIZE, "onnx.save_model",
     lambda f: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f)), 2, "space"),
    ("run-disk-full-mid-onnx", RUN, "onnx.save_model",
     lambda f: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f)), 2, "space"),
    ("bench-ctrl-c-between-files", BENCH, "ffnquant.report.latency.latency_markdown", None, 130, "interrupt"),
]


@pytest.mark.parametrize("case_id, argv, target, exc_fn, code, word", INTERRUPTIONS,
                         ids=[i[0] for i in INTERRUPTIONS])
def test_interrupted_mid_write_leaves_nothing(case_id, argv, target, exc_fn, code, word, tmp_path, capsys, monkeypatch):
    import onnx  # noqa: F401 - patched by name below

    import ffnquant.bench  # noqa: F401

    monkeypatch.chdir(tmp_path)
    places = make_layout(tmp_path)
    before = snapshot(tmp_path)
    if exc_fn is None:
        def raiser(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr(target, raiser)
    else:
        monkeypatch.setattr(target, _partial_then(exc_fn))
    outcome = run_in_process([a.format(**places) for a in argv], capsys)
    assert outcome.crashed is None, f"{case_id}: {outcome.crashed}\nstderr:\n{outcome.stderr[-3000:]}"
    assert outcome.rc == code, f"{case_id}: exit {outcome.rc}, expected {code}\nstderr:\n{outcome.stderr[-3000:]}"
    assert "Traceback" not in outcome.stderr
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0].lower(), f"{case_id}: stderr is not one line naming {word!r}:\n{outcome.stderr}"
    changes = diff(before, snapshot(tmp_path))
    assert not changes, f"{case_id}: {changes} (the message was: {lines[0]})"


def _interruptible() -> None:
    """In the child: Ctrl-C as at a terminal. A suite started as a background job inherits SIGINT ignored, which
    Python keeps ignored (and `nohup` ignores SIGHUP); the test sends the real signal and needs it delivered."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)],
                         ids=["sigint", "sigterm", "sighup"])
def test_real_sigint_mid_bench_leaves_nothing(tmp_path, sig, code):
    """A real Ctrl-C (SIGINT), SIGTERM or SIGHUP while `bench` measures: exit 128 + the signal, one true line,
    the folders as they were."""
    places = make_layout(tmp_path)
    before = snapshot(tmp_path)
    argv = [a.format(**places) for a in BENCH] + ["--tokens", "1,2,4,8", "--budget-s", "3"]
    proc = subprocess.Popen([sys.executable, "-m", "ffnquant", *argv], cwd=tmp_path, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_interruptible)
    # wait until the command is past its start-up (it has touched --out) or a few seconds have gone
    out = tmp_path / "out"
    names = set(os.listdir(out))
    deadline = time.monotonic() + 8.0
    while time.monotonic() < deadline and set(os.listdir(out)) == names and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.5)
    assert proc.poll() is None, f"bench ended before the interrupt: rc {proc.returncode}, {proc.stderr.read()}"
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"bench did not stop within 20 s of {sig.name}")
    assert proc.returncode == code, f"exit {proc.returncode}\n{err}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "interrupt" in lines[0].lower(), err
    assert not diff(before, snapshot(tmp_path)), diff(before, snapshot(tmp_path))
