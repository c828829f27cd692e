"""The engine that runs a causal LM for every command: its own transformers class, one decoder layer at a time.

The transformers model is built from config.json (with its parameters on the meta device when the weights are
read a layer at a time; loaded whole when the model is `resident`). Each batch runs through the model's own
forward with stand-ins for the decoder layers, which record the embeddings and what the forward builds for each
layer (rotary position embeddings, causal masks, sliding windows: the class's own). Then each decoder layer in
turn runs on every batch's hidden states (its FFNs' inputs captured by `capture.ffn_input_hooks`, or quantized
FFNs put in by `install_ffns`); streamed, it is read from the safetensors shards before and put back on the meta
device after. The model's own forward finishes the last hidden states (final norm, LM head).

The modes run the same calls on the same arithmetic, so every figure is the same in each
(tests/test_hf_stream.py), and the same as transformers' whole forward. The arithmetic is float32, or the dtype a
runtime computes the model in (`dtype`: bf16 for a bf16 checkpoint served by transformers or vLLM); the FFN
inputs captured for calibration are float32 either way, and the checks on each layer (`check`, `fold_sites`)
run on a float32 copy of it, whose tolerances are float32's. Memory (`hf.memory.plan_memory`): the
whole model, or one decoder layer plus the kept hidden states, which are spilled to a temporary folder, a file
per batch, when they do not fit the budget.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError, first_line
from .arch import Install, ModelKind
from .capture import (
    _module_for, _quiet_transformers, ffn_input_hooks, install_ffns, load_tokenizer, model_text_batches,
    require_transformers,
)
from .checkpoint import LayerInfo, ModelInfo, _Weights
from .skeleton import base_of, causal_lm_from_config, decoder_list, parameters_on_meta, stored_names
from .head import LMHead
from .draft import feed, ids_refusal
from .recording import Recording
from .looped import Calls, dispatching
from .inputs import EvalSettings, fit_settings
from .memory import streamable_reason
from . import replay
from .forward import raised_in_transformers
from .spill import Store, set_allocator, trim
from .stream_experts import experts_made, fill_experts
from .stream_tensors import _float32, _host, _on, _read, _rounded  # noqa: F401 (_host: planning.source)
from ..infra.device import current_device, module_copy, to_device

__all__ = ["SequentialModel", "token_batches_of"]

Progress = Callable[[str, int, int], None]


# --- the model, a layer at a time -----------------------------------------------------------------------


class SequentialModel(Recording, LMHead):
    """The one engine every command runs a causal LM through: the model's own transformers class, its decoder
    layers run one at a time over batches of hidden states (`embed`, `run`, `head_out`).

    `resident`: the whole model is loaded once (transformers' from_pretrained) and every layer stays in
    memory; otherwise the model is built on the meta device and each layer's tensors are read from the safetensors
    shards as it runs and freed after (`streamable_reason`). The same calls, in the same order, on the same
    arithmetic: the modes differ only in where the weights are between calls. `dtype`: what the model computes
    in (float32 by default; a low-precision dtype as a runtime serving the checkpoint in it computes).

    `device` (default: `infra.device.current_device()`, what `--device` / `device=` set): where the layers compute.
    Resident, the whole model is put there; streamed, each layer's tensors are read onto it. Every batch of hidden
    states, each recorded call and what is captured stay in host memory and go to the device only for the call
    that reads them, so on the CPU the same code runs with every move a no-op."""

    def __init__(self, info: ModelInfo, resident: bool = False, allow_pickle: bool = False,
                 dtype: torch.dtype = torch.float32, device: torch.device | None = None, fast_head: bool = False) -> None:
        self.device = torch.device(device) if device is not None else current_device()
        # the LM head's matmul on the faster BLAS of this CPU (`infra.blas`): figures compared only with each other,
        # never with transformers' own forward bit for bit (the deployment proof's engine keeps torch's)
        self.fast_head = fast_head
        self._logits: torch.Tensor | None = None  # `head_out(reuse=True)`'s buffer
        why = None if resident else streamable_reason(info)
        if info.kind is not ModelKind.CAUSAL_LM or why:
            raise FFNQuantError(f"{info.path}: {why or streamable_reason(info)}")
        transformers = require_transformers()
        self.info, self.transformers, self.resident, self.dtype = info, transformers, resident, dtype
        if resident:
            from . import capture as _capture

            set_allocator(resident=True)  # for the rest of the process

            model = _capture.load_hf_model(info, allow_pickle=allow_pickle, dtype=dtype)  # looked up at call time
            for p in model.parameters():  # as onloaded weights: a backward pass computes no weight gradients
                p.requires_grad_(False)
            config = model.config
        else:
            set_allocator(resident=False)  # for the rest of the process
            try:
                config = transformers.AutoConfig.from_pretrained(str(info.path), local_files_only=True)
                with _quiet_transformers(transformers), parameters_on_meta():
                    try:
                        model = causal_lm_from_config(transformers, config, dtype=dtype)
                    except TypeError:  # transformers < 4.56 names it torch_dtype
                        model = causal_lm_from_config(transformers, config, torch_dtype=dtype)
            except Exception as exc:
                raise FFNQuantError(f"transformers cannot build {str(info.path)!r}: {type(exc).__name__}: {exc}") from exc
        if resident and self.device.type != "cpu":
            model = model.to(self.device)
        # a draft model (Gemma 4's assistants) runs from token ids through its target (`--target-model`)
        self.model = feed(model, info.path, load=_capture_load).eval()
        self._tuple_out = False  # whether the model's loop reads its layers' outputs as tuples (`embed` finds out)
        self._hidden_by_name = False  # whether it passes them their hidden states by name (`_record` notes it)
        self._one_pass_checked = False  # whether its forward runs each layer once, in order (`hf.forward.check_one_pass`)
        self.batch_dim: int | None = None  # the hidden states' dimension of the sequences (`hf.forward.find_batch_dim`)
        # whether its forward computes between its layers: each batch's stream is then a `hf.replay` trail
        self.replay = False
        # {layer: where its call takes the previous layer's second output} (`hf.forward.find_carried`: Zaya's router
        # states), carried per batch in each stream (`Store.carried`)
        self.carried: dict[int, tuple[str, Any]] = {}
        # the token ids' shape of each shape of hidden states `embed` recorded: what the head's forward is given
        self._ids_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
        names = [n for n, _ in model.named_modules()]
        found = {layer: _module_for(model, info, layer, names) for layer in info.layers}  # (name, module) per FFN
        lists = {decoder_list(model, name) for name, _ in found.values()}
        list_name = next(iter(lists))[0]
        if any(name != list_name for name, _ in lists) or any(
                decoder_list(model, name)[1] != layer.block for layer, (name, _) in found.items()):
            raise FFNQuantError(f"{info.path}: the FFNs of the transformers model are not one per decoder layer "
                                f"{list_name}.0, .1, ... in layer order")
        # the model's list of decoder layers; the engine's layers are its calls (`hf.looped.Calls`) where the forward
        # calls some layer more than once (a looped depth: each call one of ffnquant's layers), else the list itself
        self.blocks: nn.ModuleList = model.get_submodule(list_name)
        calls = (info.arch.fixed or {}).get("calls")
        self.layers: Any = Calls(self.blocks, calls) if calls else self.blocks
        self.base = base_of(model, list_name)
        # the module whose forward runs the layers from token ids: the base, or the whole model where the base
        # alone would hand its first layer something else (`hf.forward.base_runs_the_stack`)
        self.runner: nn.Module = self.base
        try:
            self._takes_embeds = "inputs_embeds" in inspect.signature(model.forward).parameters
        except (TypeError, ValueError):
            self._takes_embeds = True
        # each decoder layer's FFNs (none where an FFN of another shape stays float; every expert of an MoE layer)
        self.groups: list[list[LayerInfo]] = [[] for _ in range(len(self.layers))]
        for layer in info.layers:
            self.groups[layer.index].append(layer)
        # the FFN module whose weights a replacement makes unneeded: one module per block (not experts, not
        # Linears in the block itself, whose router or attention still read the block's weights)
        self.ffns = [found[g[0]][1] if len(g) == 1 and info.arch.install is Install.MODULE else None
                     for g in self.groups]
        self.embedding, self.head = model.get_input_embeddings(), model.get_output_embeddings()
        self.tied = bool(getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                                 "tie_word_embeddings", False))
        self._names = {id(m): n for n, m in model.named_modules()}
        if resident:
            return
        self.weights = _Weights(info.path, False)
        self._stored = stored_names(model, self.weights.file_of)
        # one Parameter under two names (RoBERTa's lm_head.bias and lm_head.decoder.bias): stored under one of them
        aliases: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(name)
        # routed experts' tensors the checkpoint does not store as the module holds them (per expert on disk, fused
        # as transformers loads them): made from each expert's FFN as `hf.checkpoint` reads it (`stream_experts.fill_experts`)
        self._made = experts_made(model, info, found, self.weights, self._stored)
        self._ffn_reader: Any = None  # the checkpoint's FFN tensors as `hf.checkpoint` reads them, when first needed
        for name, p in model.named_parameters(remove_duplicate=False):
            if self.tied and name == self._names[id(self.head)] + ".weight":
                continue  # the embedding's, as from_pretrained ties it
            if name in self._made:
                continue
            stored = self._stored.get(name, name)
            if stored not in self.weights.file_of:
                found = [self._stored.get(a, a) for a in aliases[id(p)] if self._stored.get(a, a) in self.weights.file_of]
                if found:
                    self._stored[name] = stored = found[0]
            if stored not in self.weights.file_of or tuple(self.weights.shape(stored)) != tuple(p.shape):
                raise FFNQuantError(f"{info.path}: tensor {name!r} {list(p.shape)} of the transformers model is not in "
                                    "the checkpoint with that shape; reading a layer at a time reads every module's "
                                    "tensors by name: run it whole (--no-sequential)")

    def onload(self, module: nn.Module, skip: nn.Module | Sequence[nn.Module] | None = None) -> None:
        """`module`'s parameters read from the shards in the engine's dtype, one tensor at a time (those of its
        submodule(s) `skip` left as they are)."""
        if self.resident:
            return
        prefix = self._names[id(module)]
        skips = [skip] if isinstance(skip, nn.Module) else list(skip or ())
        skipped = {id(p) for s in skips for p in s.parameters()}
        read: dict[int, nn.Parameter] = {}  # a Parameter under two names is read once and stays one Parameter
        made: dict[str, tuple[nn.Module, int]] = {}  # experts modules whose tensors are made: (module, layer)
        for name, p in list(module.named_parameters(remove_duplicate=False)):
            if id(p) in skipped:
                continue
            owner, _, attr = name.rpartition(".")
            full = f"{prefix}.{name}" if prefix else name
            if id(p) not in read:
                if full in self._made:  # filled below, expert by expert
                    tensor = torch.zeros(p.shape, dtype=self.dtype, device=self.device)
                    made[self._made[full][0]] = (module.get_submodule(owner), self._made[full][1])
                else:
                    tensor = _read(self.weights, self._stored.get(full, full), self.dtype).to(self.device)
                read[id(p)] = nn.Parameter(tensor, requires_grad=False)
            setattr(module.get_submodule(owner), attr, read[id(p)])
        if made and self._ffn_reader is None:  # one reader of the FFN tensors for every layer's experts
            from .checkpoint import ffn_reader

            self._ffn_reader = ffn_reader(self.info)
        for experts, j in made.values():
            fill_experts(experts, self.info, j, self._ffn_reader)

    def release(self) -> None:
        """Freed heap memory handed back to the system between layers when streamed (each layer's tensors read and
        converted would leave some behind); resident, kept for the next layer's work (`spill.set_allocator`)."""
        if not self.resident:
            trim()

    def offload(self, module: nn.Module) -> None:
        """`module`'s parameters back on the meta device: their memory is freed (buffers are kept). Resident: kept;
        the embedding of a model whose forward is replayed (`replay`) too: each replay embeds the ids again."""
        if self.resident or (self.replay and module is self.embedding):
            return
        for name, p in list(module.named_parameters()):
            owner, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner), attr, nn.Parameter(torch.empty_like(p, device="meta"),
                                                                    requires_grad=False))
        trim()

    @contextlib.contextmanager
    def _stand_ins(self, stand_ins: Sequence[nn.Module]):
        if isinstance(self.layers, Calls):  # one stand-in per call, each block's slot handing its calls on
            with dispatching(self.layers, stand_ins, str(self.info.path)):
                yield
            return
        originals = list(self.layers)
        for i, module in enumerate(stand_ins):
            module.__dict__["_layer"] = originals[i]  # not a submodule: its attributes only
            self.layers[i] = module
        try:
            yield
        finally:
            for i, module in enumerate(originals):
                self.layers[i] = module

    def rows(self, hidden: torch.Tensor, n: int) -> torch.Tensor:
        """The hidden states of a batch's first `n` sequences (along `batch_dim`)."""
        return replay.rows(hidden, n, self.batch_dim or 0)

    def run(self, j: int, store: Store, calls: Sequence, capture: dict[str, list] | None = None,
            ffns: Mapping[str, Any] | None = None) -> None:
        """Decoder layer `j` (onloaded) over every batch of `store`, outputs replacing inputs. `capture`: each of
        its FFNs' inputs [tokens, d_model] appended under the FFN's label (an expert's: the tokens the router sent
        it; none in a batch where it got none); `ffns`: callables computing in place of FFNs, by label."""
        group = self.groups[j]
        by_label = {layer.label: layer for layer in group}

        def sink(layer: LayerInfo, x: torch.Tensor) -> None:
            if x.shape[0]:  # float32 whatever the engine computes in (ffn_input_hooks): what calibration reads
                capture.setdefault(layer.label, []).append(_host(x))

        hooks = ffn_input_hooks(self.model, self.info, group, sink) if capture is not None and group \
            else contextlib.nullcontext()
        swap = install_ffns(self.model, self.info, {by_label[k]: _on(f, self.device) for k, f in ffns.items()}) \
            if ffns else contextlib.nullcontext()
        with hooks, swap, torch.no_grad():
            for b in sorted(store.items):
                item = store.get(b)
                raw = self._layer(j, replay.current(item), self._call(j, b, store, calls))
                out = _host(raw[0] if isinstance(raw, (tuple, list)) else raw)  # OpenAI GPT's blocks return a list
                if j + 1 in self.carried:  # handed to the next layer by the model's loop
                    store.carried[b] = _host(raw[1])
                if self.replay:  # its second output too where the loop reads outputs by field (Reformer's
                    # attn_output, which the next layer and the model's output read)
                    second = _host(raw[1]) if not isinstance(self._tuple_out, bool) and isinstance(raw, tuple) \
                        and isinstance(raw[1], torch.Tensor) else None
                    item = replay.advanced(self, item, out, j, second)
                    call = item.pop("call", None)
                    if call is not None:  # the next layer's call as the forward computed it from the outputs so far
                        store.calls[b] = _host(call)
                    out = _host(item)
                store.put(b, out)

    def _call(self, j: int, b: int, store: Store, calls: Sequence) -> tuple[tuple, dict[str, Any]]:
        """Layer j's recorded call for batch b, with what the previous layer of `store`'s stream handed on in place
        where the model's loop hands it (`carried`)."""
        call = store.calls.get(b, calls[b][j])  # as replayed (`hf.replay`), where the stream was
        if j not in self.carried:
            return call
        if b not in store.carried:
            raise RuntimeError(f"stream {store.name!r} holds no output of layer {j - 1} for batch {b} to hand to "
                               f"layer {j}")
        (kind, key), (args, kwargs) = self.carried[j], call
        if kind == "arg":
            return tuple(store.carried[b] if i == key else a for i, a in enumerate(args)), kwargs
        return args, {**kwargs, key: store.carried[b]}

    def _block(self, j: int, hidden: torch.Tensor, call: tuple[tuple, dict[str, Any]],
               device: torch.device | None = None) -> torch.Tensor:
        """Decoder layer j on one batch, on `device` (the engine's); the output back in host memory."""
        out = self._layer(j, hidden, call, device)
        return _host(out[0] if isinstance(out, (tuple, list)) else out)  # OpenAI GPT's blocks return a list

    def _layer(self, j: int, hidden: torch.Tensor, call: tuple[tuple, dict[str, Any]],
               device: torch.device | None = None) -> Any:
        """Decoder layer j on one batch, on `device` (the engine's): its output as the layer returns it."""
        device = device or self.device
        args, kwargs = to_device(call, device)
        try:
            if self._hidden_by_name:  # as the model's loop passes it (Reformer's layers take prev_attn_output first)
                out = self.layers[j](*args, hidden_states=hidden.to(device), **kwargs)
            else:
                out = self.layers[j](hidden.to(device), *args, **kwargs)
        except Exception as exc:
            if not raised_in_transformers(exc):
                raise
            # the model's own layer refuses what its own forward passed it for token ids alone (Gemma 4's draft
            # model reads its target model's key/value states): a model ffnquant cannot run, not a bug of ffnquant
            causal = ids_refusal(self.model)
            raise FFNQuantError(
                f"{self.info.path}: transformers' decoder layer {j} ({type(self.layers[j]).__name__}) fails on the "
                f"inputs its model's forward passes it for token ids alone ({type(exc).__name__}: {first_line(exc)}); "
                + (f"its causal LM's own forward refuses token ids alone ({causal}): " if causal else "")
                + "ffnquant runs a causal LM from token ids, and this one does not run from them as configured (its "
                "config.json inconsistent, or more inputs needed: a draft model's target states, images, ...)") from None
        return out

    def check(self, j: int, store: Store, calls: Sequence, hf_layers: Sequence[Any]) -> dict[str, float]:
        """ffnquant's FFNs of layer `j` (`hf_layers`, onloaded layer) against the model's own modules on the first
        batch's inputs (`hf.graph.check_reproduction`): raises, naming the layer, before anything is quantized."""
        from .graph import check_reproduction

        if not hf_layers or not len(store):
            return {}
        b = min(store.items)
        if self.dtype is not torch.float32:  # ffnquant's FFNs with the weights the model holds in its dtype
            hf_layers = [_rounded(layer, self.dtype) for layer in hf_layers]
        if self.device.type != "cpu":  # compared where the layer ran: the check computes on its FFNs' device
            hf_layers = [dataclasses.replace(layer, ffn=module_copy(layer.ffn, self.device)) for layer in hf_layers]
        with self._in_float32(j):
            return check_reproduction(self.model, self.info, hf_layers,
                                      run=lambda: self._block(j, _float32(replay.current(store.get(b))),
                                                              _float32(self._call(j, b, store, calls))))

    def fold_sites(self, j: int, store: Store, calls: Sequence) -> dict[LayerInfo, Any]:
        """Where layer `j`'s FFN input scale folds, or why not (`hf.graph.fold_sites`), from the layer (onloaded)
        run on the first batch of `store`: the check compares the layer's output, which is all a fold can change."""
        from .graph import fold_sites

        if not self.groups[j] or not len(store):
            return {}
        b = min(store.items)
        with self._in_float32(j):
            return fold_sites(self.model, self.info, self.groups[j],
                              run=lambda: self._block(j, _float32(replay.current(store.get(b))),
                                                      _float32(self._call(j, b, store, calls))))

    @contextlib.contextmanager
    def _in_float32(self, j: int):
        """While active, decoder layer `j` (onloaded) is a float32 copy of itself when the engine computes in
        another dtype: the checks measure ffnquant's FFN and a fold against float32 rounding, whatever the
        runtime's precision (the inputs are the engine's, converted). The copy is on the engine's device, where the
        checks run (`graph.check_reproduction` compares on the device of ffnquant's FFN)."""
        if self.dtype is torch.float32:
            yield
            return
        original = self.layers[j]
        self.layers[j] = copy.deepcopy(original).float()
        try:
            yield
        finally:
            self.layers[j] = original

    def _read_stored(self, name: str) -> torch.Tensor:
        """The checkpoint's tensor `name` (as transformers names it) in the engine's dtype, on its device."""
        return _read(self.weights, self._stored.get(name, name), self.dtype).to(self.device)

    @contextlib.contextmanager
    def layer(self, j: int, ffn: bool = True):
        """Decoder layer `j` onloaded while active, offloaded afterwards; without `ffn`, its FFN's weights are not
        read (for runs where a replacement computes in the FFN's place: `run(..., ffns=...)`)."""
        self.onload(self.layers[j], None if ffn else self.ffns[j])  # no single FFN module: all read
        try:
            yield self.layers[j]
        finally:
            self.offload(self.layers[j])


def _capture_load(*args: Any, **kwargs: Any) -> nn.Module:
    """`capture.load_hf_model`, looked up at call time (tests replace it)."""
    from . import capture

    return capture.load_hf_model(*args, **kwargs)


def token_batches_of(info: ModelInfo, text, split: str, settings: EvalSettings, max_tokens: int) -> list[torch.Tensor]:
    """The token id batches `capture_layer_inputs` runs for `split` ('calibration' or 'evaluation')."""
    settings = fit_settings(info, settings)
    return model_text_batches(info, load_tokenizer(info.path), text, split, settings.seq_len, settings.batch_size,
                              max_tokens)
