"""Run a local Hugging Face model and capture each FFN's input; put replacement FFNs into it.

Needs the optional `transformers` package (`pip install '.[hf]'`); everything is
local (`local_files_only=True`). Capture uses forward pre-hooks on the model's own MLP
modules and hands each FFN's input to a callback one batch at a time, so nothing holds
more than one batch of activations. Without transformers, `iter_captured_files` reads
activations captured elsewhere (.npy / .safetensors, [tokens, d_model] per layer).
"""

from __future__ import annotations

import contextlib
import os
import re
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ..data import load_tokens
from ..errors import FFNQuantError
from ..infra.atomic import atomic_path, ensure_writable_dir, owned_temp_file
from ..infra.resources import check_memory
from .arch import Install, ModelKind
from .checkpoint import LayerInfo, ModelInfo, inspect_model
from .routed import call_modules, experts_forward, matrix_forwards, routed_rows
from .corpus import (DEFAULT_SEQ_LEN, TextSource, document_text, document_windows, load_documents, shipped_corpus,
                     source_items, source_label, window_batches)

__all__ = [
    "TEXT_SPLITS",
    "transformers_available",
    "require_transformers",
    "default_text_path",
    "read_text",
    "text_paths",
    "text_label",
    "load_hf_model",
    "load_tokenizer",
    "token_batches",
    "text_batches",
    "vocab_size",
    "check_token_ids",
    "check_tokenizer",
    "model_text_batches",
    "ffn_input_hooks",
    "shift_right",
    "iter_captured",
    "install_ffns",
    "save_captured",
    "captured_file",
    "iter_captured_files",
]

# The small shipped sample texts (ffnquant/data/TEXTS.md), kept for `adequacy --shift-text code` and the tests'
# tokenizers; the default calibration and evaluation data are the shipped corpora (`hf.corpus`).
TEXT_SPLITS = {"calibration": "calibration.txt", "evaluation": "evaluation.txt",
               # Python source (PSF license), a different domain for shift checks (`ffnquant model adequacy`)
               "code": "code.txt"}


def transformers_available() -> tuple[bool, str]:
    """(True, version) if transformers imports, else (False, the reason)."""
    try:
        import transformers
    except Exception as exc:  # ImportError, or a broken install raising something else
        return False, f"transformers is not importable ({type(exc).__name__}: {exc}); pip install '.[hf]' from the ffnquant checkout"
    return True, transformers.__version__


def require_transformers():
    """The transformers module, or a one-line error saying how to get it."""
    ok, why = transformers_available()
    if not ok:
        raise FFNQuantError(f"running a Hugging Face model needs transformers: {why}; "
                            "without it, pass captured activations from files")
    import transformers

    return transformers


def default_text_path(split: str) -> Path:
    """Path of the shipped sample text for 'calibration', 'evaluation' or 'code' (ffnquant/data/TEXTS.md)."""
    if split not in TEXT_SPLITS:
        from ..errors import unknown_choice

        raise unknown_choice("text split", split, list(TEXT_SPLITS))
    return Path(str(resources.files("ffnquant") / "data" / TEXT_SPLITS[split]))


def text_paths(path: str | os.PathLike | Sequence[str | os.PathLike] | TextSource | None, split: str) -> list[Path]:
    """The files of `path`: one, several (a list, or one comma-separated string, as the CLI's repeated --text gives
    them), a TextSource's; a shipped corpus name is its file; None is the default corpus for `split` (`hf.corpus`)."""
    out = []
    for item in source_items(path, split):
        corpus = shipped_corpus(item, split) if not os.path.exists(item) else None
        out.append(corpus.path if corpus is not None else Path(item))
    return out


def text_label(path: str | os.PathLike | Sequence[str | os.PathLike] | TextSource | None, split: str) -> str:
    """How reports name the text(s): 'prose:calibration (shipped corpus)', the file, 'a.txt + b.jsonl'."""
    return source_label(path, split)


def read_text(path: str | os.PathLike | Sequence[str | os.PathLike] | TextSource | None, split: str) -> str:
    """The text of every document of `path` (`hf.corpus.load_documents`), a blank line apart: one-line errors for
    a missing, unreadable or empty file, a JSONL row without its field, or an unknown corpus name."""
    return "\n\n".join(document_text(d) for d in load_documents(path, split))


def load_hf_model(info: ModelInfo | str | os.PathLike, allow_pickle: bool = False,
                  dtype: torch.dtype = torch.float32) -> nn.Module:
    """The transformers model of a folder in eval mode, its parameters in `dtype` (fp32 by default), local files
    only (LM head for causal/seq2seq)."""
    transformers = require_transformers()
    if not isinstance(info, ModelInfo):
        info = inspect_model(info, allow_pickle=allow_pickle)
    # Every tensor of the checkpoint in fp32 (config.json's ones without tensors, e.g. tied heads, aside).
    size, name = torch.finfo(dtype).bits // 8, {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    check_memory(info.n_params_total * size, f"the model {str(info.path)!r} ({info.n_params_total:,} parameters in {name})",
                 "choose a smaller model, or pass captured activations instead of running it", "to load")
    auto = {
        ModelKind.CAUSAL_LM: transformers.AutoModelForCausalLM,
        ModelKind.ENCODER: transformers.AutoModel,
        ModelKind.SEQ2SEQ: transformers.AutoModelForSeq2SeqLM,
    }[info.kind]
    if info.kind is ModelKind.CAUSAL_LM:  # the class config.json names where the auto mapping lacks its type
        from .draft import require_target
        from .skeleton import causal_lm_class

        require_target(info.path)  # a draft model without its target: refused before it is read

        with _quiet_transformers(transformers):
            auto = causal_lm_class(transformers, info.path)
    # use_kernels=False: the model's own PyTorch modules, never layers swapped for Hub kernels (transformers >= 5.2x
    # kernelizes by default and refuses to load without the `kernels` package): ffnquant measures and reproduces
    # that forward bit for bit
    kwargs: dict[str, Any] = {"local_files_only": True, "use_safetensors": info.weights_format == "safetensors",
                              "use_kernels": False}
    try:
        with _quiet_transformers(transformers):
            try:
                model = auto.from_pretrained(str(info.path), dtype=dtype, **kwargs)
            except TypeError:  # transformers < 4.56 names it torch_dtype
                model = auto.from_pretrained(str(info.path), torch_dtype=dtype, **kwargs)
    except FFNQuantError:
        raise
    except Exception as exc:
        raise FFNQuantError(f"transformers cannot load {str(info.path)!r}: {type(exc).__name__}: {exc}") from exc
    if info.kind is ModelKind.CAUSAL_LM:  # a draft model runs from token ids through its target (`hf.draft`)
        from .draft import feed

        feed(model, str(info.path), load=load_hf_model)
    return model.eval()


@contextlib.contextmanager
def _quiet_transformers(transformers):
    """transformers' own 'Loading weights' tqdm bar off while ffnquant loads a model (ffnquant's commands show
    their own progress; a library never prints); the caller's setting is restored afterwards."""
    tl = getattr(getattr(transformers, "utils", None), "logging", None)
    if tl is None or not hasattr(tl, "is_progress_bar_enabled"):
        yield
        return
    was = tl.is_progress_bar_enabled()
    tl.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            tl.enable_progress_bar()


# the tokenizers loaded in this process, by folder and its files' (name, size, mtime): a plan reads the same folder's
# tokenizer three times (the memory planner, the search text, the held-out text), seconds each at a 262k vocabulary
_TOKENIZERS: dict[tuple, Any] = {}


def _tokenizer_key(path: str | os.PathLike) -> tuple:
    folder = os.path.realpath(path)
    try:
        files = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(folder)
                             if e.is_file() and not e.name.endswith((".safetensors", ".bin", ".pt", ".gguf"))))
    except OSError:
        files = ()
    return folder, files


def load_tokenizer(path: str | os.PathLike):
    """The folder's own tokenizer (local files only); loaded once per process while the folder's files stay the same
    (callers read it, never change it)."""
    transformers = require_transformers()
    key = _tokenizer_key(path)
    if key in _TOKENIZERS:
        return _TOKENIZERS[key]
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if len(_TOKENIZERS) >= 4:  # a few models at a time (a plan and its peer model, tests' tiny folders)
            _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
        _TOKENIZERS[key] = tok
        return tok
    except Exception as exc:
        raise FFNQuantError(
            f"{str(path)!r} has no usable tokenizer ({type(exc).__name__}: {exc}); "
            "save the model's tokenizer into the folder or pass token ids"
        ) from exc


def token_batches(
    ids: Sequence[int] | torch.Tensor, seq_len: int = 128, batch_size: int = 4, max_tokens: int | None = None
) -> list[torch.Tensor]:
    """Split a token id stream into [batch, seq_len] batches (a shorter last sequence in its own batch)."""
    ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() < 2:
        raise FFNQuantError(f"the text gives {ids.numel()} token(s); at least 2 are needed")
    if seq_len < 2 or batch_size < 1:
        raise FFNQuantError(f"seq_len must be >= 2 and batch_size >= 1, got {seq_len} and {batch_size}")
    n_full = ids.numel() // seq_len
    full = ids[: n_full * seq_len].reshape(n_full, seq_len)
    batches = [full[i : i + batch_size] for i in range(0, n_full, batch_size)]
    rest = ids[n_full * seq_len :]
    if rest.numel() >= 2:
        batches.append(rest.reshape(1, -1))
    return batches


def text_batches(tokenizer, text: str, seq_len: int = 128, batch_size: int = 4, max_tokens: int | None = None):
    """Batches of `text` as one document, in windows as the model sees text (`hf.corpus.document_windows`)."""
    return window_batches(document_windows(tokenizer, [text], seq_len, max_tokens), batch_size)


def vocab_size(info: ModelInfo) -> int | None:
    """config.json's vocab_size (the rows of the model's embedding), or None when it gives none."""
    value = info.config.get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def check_token_ids(info: ModelInfo, batches: Sequence[torch.Tensor], what: str) -> None:
    """Refuse token ids the model's embedding has no row for, before the model runs (else an IndexError deep in torch)."""
    vocab = vocab_size(info)
    if vocab is None or not batches:
        return
    top = max(int(b.max()) for b in batches)
    if top >= vocab:
        raise FFNQuantError(
            f"the tokenizer of {str(info.path)!r} gives token id {top} on {what}, but config.json's vocab_size is "
            f"{vocab} (the model's embedding rows, ids 0-{vocab - 1}): the tokenizer does not belong to this model; "
            "save the model's own tokenizer into the folder"
        )


def check_tokenizer(info: ModelInfo, texts: Mapping[str, str | os.PathLike | None]) -> None:
    """Load the folder's tokenizer and check its ids on each text ({split: path or None}) against config.json,
    without loading the model: for callers that validate every input before starting."""
    tokenizer = load_tokenizer(info.path)
    for split, path in texts.items():
        # every token of the text is checked; the window shape does not matter here
        model_text_batches(info, tokenizer, path, split, DEFAULT_SEQ_LEN, 64, None)


def model_text_batches(info: ModelInfo, tokenizer, path: str | os.PathLike | TextSource | None, split: str, seq_len: int,
                       batch_size: int, max_tokens: int | None, n_samples: int | None = None) -> list[torch.Tensor]:
    """The batches every command runs a model on: the documents of `path` (a shipped corpus name, files of any
    supported kind, a TextSource; default: the shipped prose corpus' `split`) in windows of `seq_len` tokens
    starting at document starts with the tokenizer's BOS (`hf.corpus.document_windows`), at most `max_tokens`
    tokens and `n_samples` windows; ids checked against config.json."""
    chat = isinstance(path, TextSource) and path.chat_template
    windows = document_windows(tokenizer, load_documents(path, split), seq_len, max_tokens, n_samples, chat)
    batches = window_batches(windows, batch_size)
    check_token_ids(info, batches, f"the {split} text")
    return batches


# --- locating the FFNs in a loaded transformers model ------------------------------------


def _module_for(model: nn.Module, info: ModelInfo, layer: LayerInfo, names: Sequence[str]) -> tuple[str, nn.Module]:
    pattern = re.compile(info.arch.module_pattern.format(layer=layer.block, stack=re.escape(layer.stack)))
    hits = [n for n in names if pattern.fullmatch(n)]
    if len(hits) != 1:
        raise FFNQuantError(
            f"cannot find the FFN module of {info.arch.name} layer {layer.index} ({layer.name}) in the loaded "
            f"transformers model: {len(hits)} modules match {pattern.pattern!r}"
        )
    return hits[0], model.get_submodule(hits[0])


def _resolve_attr(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    parent = root
    *path, last = dotted.split(".")
    for part in path:
        parent = getattr(parent, part)
    return parent, last


def _fused_experts(module: nn.Module, expert: int) -> bool:
    """True when the experts module holds all experts' weights as 3-D tensors (transformers >= 5)."""
    return not (isinstance(module, nn.ModuleList) or hasattr(module, str(expert)))


def _first_input(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor:
    if args:
        return args[0]
    for key in ("hidden_states", "x", "input"):
        if key in kwargs:
            return kwargs[key]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


@contextlib.contextmanager
def ffn_input_hooks(
    model: nn.Module, info: ModelInfo, layers: Sequence[LayerInfo], sink: Callable[[LayerInfo, torch.Tensor], None]
) -> Iterator[None]:
    """While active, every forward pass calls `sink(layer, x)` with each selected FFN's input [tokens, d_model].

    Mixture-of-experts: each expert sees only the tokens the router sends it, as in the model.
    """
    names = [n for n, _ in model.named_modules()]
    handles = []

    def plain_hook(layer: LayerInfo):
        def hook(module, args, kwargs):
            x = _first_input(args, kwargs)
            sink(layer, x.detach().reshape(-1, x.shape[-1]).float())

        return hook

    def experts_hook(group: list[LayerInfo]):
        def hook(module, args, kwargs):
            hidden, top_k_index, _ = routed_rows(module, args, kwargs)
            hidden = hidden.detach().float()
            # the rows routed to each expert; a zero row is a token not routed there (Llama 4's stacked rows)
            nonzero = (hidden != 0).any(dim=-1)
            for layer in group:
                sink(layer, hidden[(top_k_index == layer.expert).any(dim=-1) & nonzero])

        return hook

    try:
        fused_groups: dict[str, tuple[nn.Module, list[LayerInfo]]] = {}
        for layer in layers:
            _, module = _module_for(model, info, layer, names)
            if info.arch.install is Install.SPLIT:
                parent, attr = _resolve_attr(module, info.arch.split_attrs[0])
                target = getattr(parent, attr)
            elif info.arch.install is Install.EXPERTS:
                if _fused_experts(module, layer.expert):
                    key = str(id(module))
                    fused_groups.setdefault(key, (module, []))[1].append(layer)
                    continue
                target = module[layer.expert] if isinstance(module, nn.ModuleList) else getattr(module, str(layer.expert))
            else:
                target = module
            handles.append(target.register_forward_pre_hook(plain_hook(layer), with_kwargs=True))
        for module, group in fused_groups.values():  # where the experts are handed their rows
            handles.append(call_modules(module, info.arch)[0].register_forward_pre_hook(experts_hook(group),
                                                                                       with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def shift_right(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Decoder inputs for teacher forcing: the start token, then the ids without the last one."""
    config = model.config
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(config, "pad_token_id", None) or 0  # T5 starts decoding from its pad id (0)
    out = torch.full_like(ids, int(start))
    out[:, 1:] = ids[:, :-1]
    return out


def _model_inputs(info: ModelInfo, model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    if info.kind is ModelKind.SEQ2SEQ:
        # teacher forcing on the same window, so the decoder's FFNs run too
        return {"input_ids": ids, "decoder_input_ids": shift_right(model, ids)}
    return {"input_ids": ids}


def iter_captured(
    model: nn.Module, info: ModelInfo, layers: Sequence[LayerInfo], batches: Sequence[torch.Tensor]
) -> Iterator[dict[str, torch.Tensor]]:
    """Run the model batch by batch; yield {layer label: captured input [tokens, d_model]} per batch.

    Only one batch's captures are alive at a time; experts the router skipped in a batch are absent.
    """
    for ids in batches:
        check_token_ids(info, [ids], "its input")  # callers that tokenized without checking
        captured: dict[str, list[torch.Tensor]] = {}

        def sink(layer: LayerInfo, x: torch.Tensor) -> None:
            if x.shape[0]:
                captured.setdefault(layer.label, []).append(x)

        with ffn_input_hooks(model, info, layers, sink), torch.no_grad():
            model(**_model_inputs(info, model, ids))
        yield {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in captured.items()}


# --- putting replacement FFNs into the model ---------------------------------------------


@contextlib.contextmanager
def install_ffns(
    model: nn.Module, info: ModelInfo, replacements: Mapping[LayerInfo, Callable[[torch.Tensor], torch.Tensor]]
) -> Iterator[None]:
    """While active, each given FFN of `model` computes with its replacement (e.g. a quantized FFN).

    The original modules and forwards are restored afterwards, also on error.
    """
    names = [n for n, _ in model.named_modules()]
    undo: list[Callable[[], None]] = []
    try:
        fused: dict[int, tuple[nn.Module, dict[int, Callable]]] = {}
        installed: list[nn.Module] = []
        for layer, replacement in replacements.items():
            _, module = _module_for(model, info, layer, names)
            if info.arch.install is Install.SPLIT:
                first, act, second = info.arch.split_attrs
                for dotted, new in ((first, replacement), (act, nn.Identity()), (second, nn.Identity())):
                    parent, attr = _resolve_attr(module, dotted)
                    old = getattr(parent, attr)
                    setattr(parent, attr, new if isinstance(new, nn.Module) else _Callable(new))
                    undo.append(lambda p=parent, a=attr, o=old: setattr(p, a, o))
                continue
            if info.arch.install is Install.EXPERTS:
                if _fused_experts(module, layer.expert):
                    fused.setdefault(id(module), (module, {}))[1][layer.expert] = replacement
                    continue
                module = module[layer.expert] if isinstance(module, nn.ModuleList) else getattr(module, str(layer.expert))
            if "forward" in module.__dict__ and any(m is module for m in installed):
                continue  # a later call of an FFN called again (a looped depth): its one replacement is in place
            installed.append(module)
            # A plain function as instance attribute shadows the class's forward; a Module assigned
            # there would only be registered as a child named "forward" and never called.
            object.__setattr__(module, "forward", _input_only(replacement, info.arch.residual_arg))
            undo.append(lambda m=module: delattr(m, "forward"))
        for module, reps in fused.values():
            forwards = matrix_forwards(module, reps, info.arch) if info.arch.matrix_experts \
                else {module: experts_forward(module, reps, info.arch)}
            for target, forward in forwards.items():
                object.__setattr__(target, "forward", forward)
                undo.append(lambda m=target: delattr(m, "forward"))
        yield
    finally:
        for step in reversed(undo):
            step()


def _residual_input(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor:
    """The block's residual an FFN module of `Arch.residual_arg` receives beside its input (BLOOM, MPT)."""
    return args[1] if len(args) > 1 else kwargs["residual"]


def _input_only(fn: Callable[[torch.Tensor], torch.Tensor], residual: bool = False) -> Callable[..., torch.Tensor]:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = fn(_first_input(args, kwargs))
        # a module that adds the block's residual (`Arch.residual_arg`): its replacement adds it alike
        return out + _residual_input(args, kwargs) if residual else out

    return forward


class _Callable(nn.Module):
    """Wraps a plain callable so it can sit where a module attribute is expected."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


# --- captured activations in files ------------------------------------------------------


def captured_file(folder: str | os.PathLike, label: str) -> Path:
    """Where `save_captured` puts a layer's inputs: <folder>/<label>.npy."""
    return Path(folder) / f"{label}.npy"


def save_captured(folder: str | os.PathLike, captured: Iterator[Mapping[str, torch.Tensor]], d_model: int) -> dict[str, Path]:
    """Stream captured batches into one .npy [tokens, d_model] float32 file per layer.

    Rows are appended to a raw temporary file per layer and the .npy header is written
    once the row count is known, so memory stays at one batch.
    """
    folder = ensure_writable_dir(folder)
    raw: dict[str, tuple[Any, Path, int]] = {}
    try:
        for batch in captured:
            for label, x in batch.items():
                if label not in raw:
                    tmp = owned_temp_file(folder, f"{label}.rows")  # named as ours: a sweep never takes a user's file
                    raw[label] = (open(tmp, "wb"), tmp, 0)
                fh, tmp, n = raw[label]
                fh.write(x.detach().to(torch.float32).contiguous().numpy().tobytes())
                raw[label] = (fh, tmp, n + x.shape[0])
        out: dict[str, Path] = {}
        for label, (fh, tmp, n) in raw.items():
            fh.close()
            target = captured_file(folder, label)
            with atomic_path(target) as dest, open(dest, "wb") as o, open(tmp, "rb") as src:
                header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)), "fortran_order": False,
                          "shape": (n, d_model)}
                np.lib.format.write_array_header_1_0(o, header)
                while chunk := src.read(1 << 22):
                    o.write(chunk)
            out[label] = target
        return out
    finally:
        for fh, tmp, _ in raw.values():
            fh.close()
            if tmp.exists():
                tmp.unlink()


def iter_captured_files(
    source: str | os.PathLike, labels: Sequence[str], d_model: int, chunk_tokens: int = 4096
) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, chunk [<= chunk_tokens, d_model]) for each layer, one layer's file at a time.

    `source` is a folder with <label>.npy or <label>.safetensors per layer (labels as
    `LayerInfo.label`: L0, L1, L3.e2, ...), or one .safetensors file with a tensor per label.
    """
    src = Path(source)
    if not src.exists():
        raise FFNQuantError(f"captured activations {str(src)!r} do not exist")
    for label in labels:
        if src.is_dir():
            candidates = [src / f"{label}.npy", src / f"{label}.safetensors"]
            # lexists: a FIFO or unreadable file is refused by name in load_tokens, not passed over
            path = next((p for p in candidates if os.path.lexists(p)), None)
            if path is None:
                raise FFNQuantError(f"{str(src)!r} has no captured activations for layer {label} (expected {label}.npy or {label}.safetensors)")
            x = load_tokens(path, d_model=d_model)
        else:
            x = load_tokens(src, d_model=d_model, name=label)
        for start in range(0, x.shape[0], chunk_tokens):
            yield label, x[start : start + chunk_tokens]
