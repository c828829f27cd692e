"""Sequential onloading: a causal LM run one decoder layer at a time, for models larger than memory.

The transformers model is built from config.json with its parameters on the meta device (buffers such as the
rotary frequencies computed as usual). The modules outside the decoder layers are read from the safetensors
shards in float32, as `load_hf_model` computes; each batch runs through the model's own forward with stand-ins
for the decoder layers, which record the embeddings and what the forward builds for each layer (rotary position
embeddings, causal masks). Then each decoder layer in turn is read, run on every batch's hidden states (its
FFN's input captured by `capture.ffn_input_hooks`, or a quantized FFN put in by `install_ffns`) and put back on
the meta device. The model's own forward finishes the last hidden states (final norm, LM head).

Same float32 arithmetic on the same batches, so the figures are bit for bit the in-memory path's
(tests/test_hf_stream.py). Memory is one decoder layer plus the hidden states of the batches (`plan_memory`),
which are spilled to a temporary folder, a file per batch, when they do not fit the budget.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from ..resources import human_bytes, memory_limit, process_rss
from .arch import Install, ModelKind
from .capture import (
    _module_for, _quiet_transformers, ffn_input_hooks, install_ffns, load_tokenizer, model_text_batches,
    require_transformers,
)
from .checkpoint import ModelInfo, _Weights
from .inputs import EvalSettings, fit_settings
from ..atomic import ScratchFolder

__all__ = ["MemoryPlan", "SequentialModel", "choose_memory_plan", "largest_layer_bytes", "plan_memory",
           "streamable_reason", "token_batches_of"]

Progress = Callable[[str, int, int], None]
# Python, torch and transformers' own memory beside the model: the modelling code imported on first use and
# the allocator's slack (reports/scale: about 300 MB between layers over what the process held before).
_RUNTIME_BYTES = 384 * 10**6


def streamable_reason(info: ModelInfo) -> str | None:
    """Why `info` cannot be run layer by layer, or None when it can: a causal LM whose FFN is one module per
    block, of any family transformers builds (found by `hf.discover`), from safetensors."""
    if info.kind is not ModelKind.CAUSAL_LM or info.arch.install is not Install.MODULE or info.n_experts:
        return (f"sequential onloading supports causal LMs whose FFN is one module per block (not mixture-of-experts "
                f"tensors or Linears in the block itself), not {info.model_type} ({info.kind}, {info.arch.install})")
    if info.weights_format != "safetensors":
        return "sequential onloading reads safetensors shards; this checkpoint is pickled"
    return None


# --- memory ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """How a model run fits in memory, and the estimates (bytes) it was chosen on: the whole model in memory, or
    streamed layer by layer with the hidden states in memory or spilled to disk."""

    sequential: bool
    spill: bool
    limit: int | None  # the budget: --max-memory, or what the process holds plus what the machine has available
    in_memory: int  # estimated peak, whole model loaded (today's path)
    streamed: int  # estimated peak, layer by layer, hidden states in memory
    spilled: int  # estimated peak, layer by layer, hidden states on disk
    layer: int  # the largest decoder layer in float32
    calibration: int  # hidden states of the calibration batches: tokens x d_model x 4
    evaluation: int  # hidden states of the held-out batches, every stream (float, quantized, one per ablated layer)
    reason: str

    @property
    def peak(self) -> int:
        return self.spilled if self.spill else self.streamed if self.sequential else self.in_memory

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak}

    def summary(self) -> str:
        """One line for the terminal: the mode, why, and the estimate against the budget."""
        mode = "whole model in memory" if not self.sequential else (
            "layer by layer, hidden states spilled to disk" if self.spill else "layer by layer")
        limit = f" of {human_bytes(self.limit)}" if self.limit is not None else ""
        return f"{mode} ({self.reason}); estimated peak {human_bytes(self.peak)}{limit}"


def plan_memory(info: ModelInfo, *, calib_tokens: int, eval_tokens: int, n_layers: int, task: str = "profile",
                ablation: bool = False, hessians: bool = False, onnx: bool = False, batch_tokens: int = 512,
                max_memory: int | None = None, sequential: bool | None = None, spill: bool | None = None,
                spill_dir: str | os.PathLike | None = None, tokens_flag: str = "--calib-tokens/--eval-tokens") -> MemoryPlan:
    """How to run `info` on `calib_tokens` calibration and `eval_tokens` held-out tokens for `task` ('profile':
    ranges of `n_layers` FFNs; 'quantize': also the quantized stream and, with `ablation`, one per layer quantized
    alone; `hessians`, `onnx`: what the quantization computes besides) under `max_memory` bytes (default: what
    this process holds plus what the machine has available). `sequential` None streams only when the whole model
    does not fit; `spill` None spills the hidden states only when they do not fit. Raises a one-line
    FFNQuantError with the numbers when nothing fits, suggesting fewer tokens by `tokens_flag`."""
    # Estimates from the shapes, with factors measured on benchmarks/scale.py's 3B Llama (reports/scale/).
    spec, d, vocab_size = info.spec, info.spec.d_model, int(info.config.get("vocab_size") or 0)
    base = process_rss() + _RUNTIME_BYTES
    limit = memory_limit(max_memory)
    ffn, tokens = spec.n_params * 4, calib_tokens + eval_tokens
    streams = 2 + (n_layers if ablation and n_layers > 1 else 0) if task == "quantize" else 0
    if task == "quantize":  # its FFN, the quantized copy and the fake quantization's temporaries of a weight (x 11
        # with the ONNX export and onnxruntime's scoring); the layer's inputs and their activations
        work = (11 if onnx else 4) * ffn + (2 * d + 3 * spec.d_ff) * tokens * 4
        work += 8 * (d * d + spec.d_ff * spec.d_ff) if hessians else 0  # float64 input Hessians
    else:  # its FFN and the tensors it is loaded from, its calibration inputs, one batch observed
        work = 2 * ffn + calib_tokens * d * 4 + 8 * batch_tokens * spec.d_ff * 4
    calibration, evaluation = calib_tokens * d * 4, streams * eval_tokens * d * 4
    batch = batch_tokens * d * 4 * 3  # a batch read, its output, the layer's temporaries
    layer = largest_layer_bytes(info)
    vocab = vocab_size * d * 4  # one vocabulary matrix: the embedding, or the head
    # the largest stage: the embedding (and a chunk of it read), one layer with its FFN inputs, the layer's consumer
    # (the layer itself offloaded meanwhile), the head with a batch's logits (doubled in float64)
    stages = max(vocab + min(vocab // 2, _READ_BYTES) + batch, layer + tokens * d * 4 + batch, work,
                 vocab + 6 * batch_tokens * vocab_size * 4)
    streamed = base + stages + calibration + evaluation
    spilled = base + stages
    captured = n_layers * tokens * d * 4 if task == "quantize" else 0
    in_memory = base + info.n_params_total * 4 + n_layers * ffn + captured + work + 6 * batch_tokens * vocab_size * 4

    detail = (f"{human_bytes(layer)} for one decoder layer in float32, {human_bytes(work)} for its "
              f"{'quantization' if task == 'quantize' else 'calibration'} on {calib_tokens:,}+{eval_tokens:,} tokens, "
              f"{human_bytes(base)} runtime")
    return choose_memory_plan(info, MemoryPlan(False, False, limit, in_memory, streamed, spilled, layer, calibration,
                                               evaluation, ""), max_memory=max_memory, sequential=sequential,
                              spill=spill, spill_dir=spill_dir, tokens_flag=tokens_flag, detail=detail,
                              spill_bytes=calibration + evaluation + batch)


def largest_layer_bytes(info: ModelInfo) -> int:
    """The largest decoder layer's parameters in float32 (from the safetensors headers; else an average)."""
    blocks = {layer.name.rsplit(".", 1)[0] + ".": 0 for layer in info.layers}  # model.layers.3.: the FFN's parent
    if info.weights_format == "safetensors":
        weights = _Weights(info.path, False)
        for name in weights.file_of:
            prefix = next((p for p in blocks if name.startswith(p)), None)
            if prefix is not None:
                blocks[prefix] += math.prod(weights.shape(name))
    return max(blocks.values()) * 4 or info.n_params_total * 4 // info.n_layers


def choose_memory_plan(info: ModelInfo, estimate: MemoryPlan, *, max_memory: int | None, sequential: bool | None,
                       spill: bool | None, spill_dir: str | os.PathLike | None, tokens_flag: str, detail: str,
                       spill_bytes: int) -> MemoryPlan:
    """The mode `estimate`'s figures allow under its `limit`: the whole model when it fits (or `sequential` is
    False), else layer by layer, with the hidden states (`spill_bytes` on disk) spilled when they do not fit or
    `spill` is True. Raises a one-line FFNQuantError with the numbers (`detail`: what the spilled peak is made of)
    and a suggestion when nothing fits."""
    from dataclasses import replace

    limit, in_memory, streamed, spilled = estimate.limit, estimate.in_memory, estimate.streamed, estimate.spilled
    calibration, evaluation = estimate.calibration, estimate.evaluation

    def plan(seq: bool, spl: bool, reason: str) -> MemoryPlan:
        return replace(estimate, sequential=seq, spill=spl, reason=reason)

    why_not = streamable_reason(info)
    fits = limit is None or in_memory <= limit
    if sequential is False or (sequential is None and (fits or why_not)):
        if not fits and (sequential is False or max_memory is not None):
            hint = f"; streamed layer by layer it would need {human_bytes(streamed)}" if not why_not else f" ({why_not})"
            raise FFNQuantError(f"{info.path}: the whole model in float32 needs about {human_bytes(in_memory)}, over "
                                f"the {human_bytes(limit)} memory budget{hint}: use a larger --max-memory"
                                + ("" if why_not else " or leave out --no-sequential"))
        return plan(False, False, "--no-sequential" if sequential is False else "it fits")
    if why_not:
        raise FFNQuantError(f"{info.path}: --sequential: {why_not}")
    reason = "--sequential" if sequential else f"the whole model needs about {human_bytes(in_memory)}"
    if spill is not True and (limit is None or streamed <= limit):
        return plan(True, False, reason)
    if limit is not None and spilled > limit:
        raise FFNQuantError(
            f"{info.path}: layer by layer this run needs about {human_bytes(spilled)} even with its hidden states "
            f"({human_bytes(calibration)} calibration + {human_bytes(evaluation)} held-out: tokens x d_model "
            f"{info.spec.d_model} x 4 bytes) on disk: {detail}; over the {human_bytes(limit)} memory budget: pass "
            f"fewer {tokens_flag} or a larger --max-memory")
    folder = Path(spill_dir) if spill_dir is not None else Path(tempfile.gettempdir())
    free = shutil.disk_usage(folder).free
    if free < spill_bytes:
        raise FFNQuantError(
            f"{info.path}: the hidden states ({human_bytes(calibration)} calibration + {human_bytes(evaluation)} "
            f"held-out) fit neither the {human_bytes(limit)} memory budget (in memory the run needs about "
            f"{human_bytes(streamed)}) nor the {human_bytes(free)} free in {folder}: pass fewer {tokens_flag}, a "
            "larger --max-memory, or point TMPDIR at a larger disk")
    return plan(True, True, reason + (f"; hidden states {human_bytes(calibration + evaluation)} spilled to {folder}"
                                      if spill is not True else "; spilled on request"))


# --- hidden states ---------------------------------------------------------------------------------------


class _Store:
    """One stream's tensors by key (a batch's hidden states [batch, seq, d_model], a layer's inputs), in memory or
    a file per key."""

    def __init__(self, folder: Path | None, name: str, items: Mapping[int, Any] | None = None) -> None:
        self.folder, self.name, self.items = folder, name, dict(items or {})

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key: int) -> torch.Tensor:
        item = self.items[key]
        return torch.load(item, weights_only=True) if isinstance(item, Path) else item

    def put(self, key: int, x: torch.Tensor) -> None:
        if self.folder is not None:
            path = self.folder / f"{self.name}.{key}.pt"
            torch.save(x, path)
            x = path
        self.items[key] = x

    def pop(self, key: int) -> None:
        """The tensor of `key` dropped (its file deleted)."""
        item = self.items.pop(key)
        if isinstance(item, Path):
            item.unlink()

    def clear(self) -> None:
        for key in list(self.items):
            self.pop(key)

    def copy(self, name: str, keys: Sequence[int] | None = None) -> "_Store":
        """A new stream starting from these tensors (those of `keys`, default all): shared until replaced in
        memory, files copied on disk."""
        keys = list(self.items) if keys is None else list(keys)
        if self.folder is None:
            return _Store(None, name, {k: self.items[k] for k in keys})
        out = _Store(self.folder, name)
        for k in keys:
            out.put(k, self.get(k))
        return out


# --- the model, a layer at a time -----------------------------------------------------------------------


def _glibc(call: str, *args: int) -> None:
    """glibc's malloc `call(*args)`; elsewhere nothing: that allocator's own policy stands."""
    try:
        import ctypes

        getattr(ctypes.CDLL("libc.so.6"), call)(*args)
    except (OSError, AttributeError):
        pass


def _trim() -> None:
    """Freed heap memory handed back: each layer's tensors read and converted would leave some behind."""
    _glibc("malloc_trim", 0)


# glibc's mmap threshold once a model streams (M_MMAP_THRESHOLD, fixed: it also stops the trim threshold growing):
# blocks from it up are mapped on their own and unmapped when freed. Left to glibc, the threshold rises to 32 MB as
# large blocks are freed; the many 4-32 MB tensors of a layer's work (activations, observer chunks, chunks read)
# are then carved from the heap, where what they leave stays resident: 0.1-0.2 GB more at the peak, varying from
# run to run (benchmarks/scale.py --trace).
_MMAP_THRESHOLD = 4 * 2**20


# Bytes of a checkpoint tensor read at once: a large tensor (the embedding: vocabulary x d_model) is read a row
# chunk at a time into its float32 copy, so neither a whole copy in the checkpoint's dtype nor the whole mapped
# tensor is resident beside it.
_READ_BYTES = 16 * 2**20


def _read_float32(weights: _Weights, name: str) -> torch.Tensor:
    """Tensor `name` of the safetensors shards in float32: `weights.get(name).to(torch.float32)`, value for value."""
    from safetensors import safe_open

    shape = weights.shape(name)
    numel = math.prod(shape)
    if not shape or numel * 4 <= 2 * _READ_BYTES:
        return weights.get(name).to(torch.float32)
    path = weights.file_of[name]
    out = torch.empty(shape, dtype=torch.float32)
    step = max(1, _READ_BYTES // (2 * (numel // shape[0])))  # rows of <= _READ_BYTES in 16-bit dtypes
    try:
        for i in range(0, shape[0], step):
            with safe_open(str(path), framework="pt") as fh:  # opened per chunk: its mapped pages go with it
                out[i:i + step].copy_(fh.get_slice(name)[i:i + step])
    except Exception as exc:
        raise FFNQuantError(f"cannot read tensor {name!r} from {str(path)!r}: {exc}") from exc
    return out


class _Stop(Exception):
    """Raised by the last stand-in: the model's forward has recorded what it builds for every layer."""


class _StandIn(nn.Module):
    """Stands in for a decoder layer while the model's own forward runs: records the arguments it is given,
    returns `hidden` (or its input unchanged) and, with `stop`, ends the forward there."""

    def __init__(self, record: list | None, hidden: torch.Tensor | None = None, stop: bool = False) -> None:
        super().__init__()
        self.record, self.hidden, self.stop = record, hidden, stop

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.record is not None:
            self.record.append((hidden_states, args, kwargs))
        if self.stop:
            raise _Stop
        return self.hidden if self.hidden is not None else hidden_states


@contextlib.contextmanager
def _parameters_on_meta():
    """While active, every parameter a module registers moves to the meta device: a model's skeleton costs no
    memory, while its buffers (rotary frequencies, embedding scales) are computed as usual. Linear and
    Embedding allocate their weight with torch.empty first, which touches no page."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class SequentialModel:
    """A causal LM from a local folder whose weights are read one module at a time (`streamable_reason`)."""

    def __init__(self, info: ModelInfo) -> None:
        why = streamable_reason(info)
        if why:
            raise FFNQuantError(f"{info.path}: {why}")
        transformers = require_transformers()
        self.info, self.transformers = info, transformers
        _glibc("mallopt", -3, _MMAP_THRESHOLD)  # M_MMAP_THRESHOLD, for the rest of the process
        try:
            config = transformers.AutoConfig.from_pretrained(str(info.path), local_files_only=True)
            with _quiet_transformers(transformers), _parameters_on_meta():
                try:
                    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
                except TypeError:  # transformers < 4.56 names it torch_dtype
                    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        except Exception as exc:
            raise FFNQuantError(f"transformers cannot build {str(info.path)!r}: {type(exc).__name__}: {exc}") from exc
        self.model = model.eval()
        names = [n for n, _ in model.named_modules()]
        found = [_module_for(model, info, layer, names) for layer in info.layers]  # (name, module) of each FFN
        self.blocks, self.ffns = [name.rsplit(".", 1)[0] for name, _ in found], [module for _, module in found]
        list_name = self.blocks[0].rsplit(".", 1)[0]
        self.layers = model.get_submodule(list_name)
        self.base = model.get_submodule(list_name.rsplit(".", 1)[0]) if "." in list_name else model
        if self.blocks != [f"{list_name}.{i}" for i in range(len(self.layers))]:
            raise FFNQuantError(f"{info.path}: the decoder layers of the transformers model are not {list_name}.0, .1, ...")
        self.weights = _Weights(info.path, False)
        self.embedding, self.head = model.get_input_embeddings(), model.get_output_embeddings()
        self.tied = bool(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                                 "tie_word_embeddings", False))
        self._names = {id(m): n for n, m in model.named_modules()}
        for name, p in model.named_parameters(remove_duplicate=False):
            if self.tied and name == self._names[id(self.head)] + ".weight":
                continue  # the embedding's, as from_pretrained ties it
            if name not in self.weights.file_of or tuple(self.weights.shape(name)) != tuple(p.shape):
                raise FFNQuantError(f"{info.path}: tensor {name!r} {list(p.shape)} of the transformers model is not in "
                                    "the checkpoint with that shape; sequential onloading reads every module's tensors "
                                    "by name: run it whole (--no-sequential)")

    def onload(self, module: nn.Module, skip: nn.Module | None = None) -> None:
        """`module`'s parameters read from the shards in float32, one tensor at a time (those of its submodule
        `skip` left on the meta device)."""
        prefix = self._names[id(module)]
        skipped = {id(p) for p in skip.parameters()} if skip is not None else set()
        for name, p in list(module.named_parameters()):
            if id(p) in skipped:
                continue
            owner, _, attr = name.rpartition(".")
            tensor = _read_float32(self.weights, f"{prefix}.{name}" if prefix else name)
            setattr(module.get_submodule(owner), attr, nn.Parameter(tensor, requires_grad=False))

    @staticmethod
    def offload(module: nn.Module) -> None:
        """`module`'s parameters back on the meta device: their memory is freed (buffers are kept)."""
        for name, p in list(module.named_parameters()):
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, nn.Parameter(torch.empty_like(p, device="meta"),
                                                                    requires_grad=False))
        _trim()

    @contextlib.contextmanager
    def _stand_ins(self, stand_ins: Sequence[nn.Module]):
        originals = list(self.layers)
        for i, module in enumerate(stand_ins):
            self.layers[i] = module
        try:
            yield
        finally:
            for i, module in enumerate(originals):
                self.layers[i] = module

    def embed(self, batches: Sequence[torch.Tensor], store: _Store, progress: Progress | None = None,
              stage: str = "embed") -> list[list[tuple[tuple, dict[str, Any]]]]:
        """Each batch's embeddings [batch, seq, d_model] put into `store`; returns per batch each layer's (args,
        kwargs) as the model's forward passes them (its KV cache left out: every window is a whole sequence).
        The modules outside the decoder layers are onloaded on the first call; `offload(embedding)` frees the
        largest of them once every text is embedded."""
        if self.embedding.weight.is_meta:
            for module in self.base.children():
                if module is not self.layers:
                    self.onload(module)
        calls = []
        n = len(self.layers)
        for b, ids in enumerate(batches):
            record: list = []
            with self._stand_ins([_StandIn(record, stop=i == n - 1) for i in range(n)]), torch.no_grad():
                try:
                    self.base(input_ids=ids)
                except _Stop:
                    pass
            store.put(b, record[0][0])
            calls.append([self._no_cache(args, kwargs) for _, args, kwargs in record])
            if progress is not None:
                progress(f"{stage}: batch {b + 1}/{len(batches)}", b + 1, len(batches))
        return calls

    def _no_cache(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        # The KV cache (a keyword, or positional as GPT-2 passes it) only keeps each layer's keys and values for a
        # later step: kept, it would hold those of every batch, and a second stream through a layer would attend
        # to the first one's keys as well.
        def drop(v: Any) -> Any:
            return None if isinstance(v, self.transformers.Cache) else v

        out = {k: drop(v) for k, v in kwargs.items()}
        if "use_cache" in out:
            out["use_cache"] = False
        return tuple(drop(a) for a in args), out

    def run(self, j: int, store: _Store, calls: Sequence, capture: list | None = None, ffn: Any = None) -> None:
        """Decoder layer `j` (onloaded) over every batch of `store`, outputs replacing inputs; its FFN's inputs
        [tokens, d_model] appended to `capture` when given; `ffn` (a callable) computing in its FFN's place."""
        layer, block = self.info.layers[j], self.layers[j]
        hooks = ffn_input_hooks(self.model, self.info, [layer], lambda _, x: capture.append(x)) \
            if capture is not None else contextlib.nullcontext()
        swap = install_ffns(self.model, self.info, {layer: ffn}) if ffn is not None else contextlib.nullcontext()
        with hooks, swap, torch.no_grad():
            for b in sorted(store.items):
                args, kwargs = calls[b][j]
                out = block(store.get(b), *args, **kwargs)
                store.put(b, out[0] if isinstance(out, tuple) else out)

    def head_out(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(final hidden state, logits) of one batch's last decoder layer output, from the model's own forward
        (final norm, LM head; onloaded on the first call): what `hf.metrics._run` reads as hidden_states[-1] (the
        base model's last_hidden_state) and logits."""
        with torch.no_grad():
            return self._head(hidden)

    def head_grad(self, hidden: torch.Tensor, loss: Callable[[torch.Tensor], torch.Tensor]):
        """`head_out` of one batch with the gradient of `loss(logits)` (a scalar) with respect to `hidden`:
        (final hidden state, logits, gradient), all detached."""
        x = hidden.detach().requires_grad_(True)
        with torch.enable_grad():
            final, logits = self._head(x)
            (grad,) = torch.autograd.grad(loss(logits), [x])
        return final.detach(), logits.detach(), grad

    def _head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.head.weight.is_meta:
            self.onload(self.embedding if self.tied else self.head)
            self.head.weight = self.embedding.weight if self.tied else self.head.weight
        got: list[torch.Tensor] = []
        n = len(self.layers)
        handle = self.base.register_forward_hook(
            lambda module, args, out: got.append(out[0] if isinstance(out, tuple) else out.last_hidden_state))
        try:
            with self._stand_ins([_StandIn(None, hidden if i == 0 else None) for i in range(n)]):
                # inputs_embeds only give the forward its shapes: the first stand-in returns `hidden`
                logits = self.model(inputs_embeds=torch.zeros_like(hidden)).logits
        finally:
            handle.remove()
        return got[0], logits

    @contextlib.contextmanager
    def layer(self, j: int, ffn: bool = True):
        """Decoder layer `j` onloaded while active, offloaded afterwards; without `ffn`, its FFN's weights are not
        read (for runs where a replacement computes in the FFN's place: `run(..., ffn=...)`)."""
        self.onload(self.layers[j], None if ffn else self.ffns[j])
        try:
            yield self.layers[j]
        finally:
            self.offload(self.layers[j])


def token_batches_of(info: ModelInfo, text, split: str, settings: EvalSettings, max_tokens: int) -> list[torch.Tensor]:
    """The token id batches `capture_layer_inputs` runs for `split` ('calibration' or 'evaluation')."""
    settings = fit_settings(info, settings)
    return model_text_batches(info, load_tokenizer(info.path), text, split, settings.seq_len, settings.batch_size,
                              max_tokens)


@contextlib.contextmanager
def _spill_folder(spill: bool, spill_dir: str | os.PathLike | None):
    with ScratchFolder("stream", dir=spill_dir) if spill else \
            contextlib.nullcontext() as folder:
        yield Path(folder) if folder else None
