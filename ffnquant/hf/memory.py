"""How a model run fits in memory: each task declares what it holds (`Needs`), and one planner (`plan_memory`)
chooses whether `hf.stream.SequentialModel` keeps the whole model resident, reads it a decoder layer at a time,
or also spills the kept hidden states to disk.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import FFNQuantError
from ..infra.device import current_device, device_free_memory
from ..infra.resources import human_bytes, memory_limit, process_rss
from .arch import ModelKind
from .checkpoint import ModelInfo, _Weights
from .draft import target_bytes

__all__ = ["MemoryPlan", "Needs", "choose_memory_plan", "export_memory_refusal", "export_peak", "largest_layer_bytes",
           "plan_memory", "profile_needs", "quantize_needs", "streamable_reason"]

# Python, torch and transformers' own memory beside the model: the modelling code imported on first use and
# the allocator's slack (reports/scale: about 300 MB between layers over what the process held before).
_RUNTIME_BYTES = 384 * 10**6

# Bytes of a checkpoint tensor read at once: a large tensor (the embedding: vocabulary x d_model) is read a row
# chunk at a time into its float32 copy, so neither a whole copy in the checkpoint's dtype nor the whole mapped
# tensor is resident beside it.
_READ_BYTES = 16 * 2**20


def streamable_reason(info: ModelInfo) -> str | None:
    """Why `info` cannot be run with its decoder layers read one at a time, or None when it can: a causal LM of
    any family transformers builds (its FFNs found by `hf.discover`; routed experts read as `hf.stream` makes
    them), from safetensors whose tensor names are the class's own. Every causal LM runs through
    `SequentialModel` whole (`resident`) either way."""
    if info.kind is not ModelKind.CAUSAL_LM:
        return (f"the layer-by-layer engine runs decoder-only causal LMs; {info.model_type} is {info.kind}: it runs "
                "whole")
    if info.weights_format != "safetensors":
        return "reading a decoder layer at a time needs safetensors; this checkpoint is pickled: the model runs whole"
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
    # where the engine computes (`infra.device`); on a GPU its own budget and estimates: the resident model(s) and
    # a layer's work there, while the host holds what is kept (and the model while it loads); None on the CPU
    device: str = "cpu"
    device_limit: int | None = None  # the device's free memory
    device_in_memory: int | None = None  # estimated device peak, whole model resident
    device_streamed: int | None = None  # estimated device peak, layer by layer (spilled or not)

    @property
    def peak(self) -> int:
        """The estimated peak of host memory in the chosen mode."""
        return self.spilled if self.spill else self.streamed if self.sequential else self.in_memory

    @property
    def device_peak(self) -> int | None:
        """The estimated peak of the device's memory in the chosen mode (None on the CPU)."""
        return self.device_streamed if self.sequential else self.device_in_memory

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak, "device_peak": self.device_peak}

    def summary(self) -> str:
        """One line for the terminal: the mode, why, and the estimates against the budgets."""
        where = "in memory" if self.device_peak is None else f"on {self.device}"
        mode = f"whole model {where}" if not self.sequential else (
            "layer by layer, hidden states spilled to disk" if self.spill else "layer by layer")
        limit = f" of {human_bytes(self.limit)}" if self.limit is not None else ""
        text = f"{mode} ({self.reason}); estimated peak {human_bytes(self.peak)}{limit}"
        if self.device_peak is not None:
            dev = f" of {human_bytes(self.device_limit)}" if self.device_limit is not None else ""
            text += f" in host memory, {human_bytes(self.device_peak)}{dev} on {self.device}"
        return text


@dataclass(frozen=True)
class Needs:
    """What a task declares it holds beside the model's own weights, in bytes: the tensors it keeps from layer to
    layer (`calibration` and `evaluation`: hidden states, FFN inputs; on disk when the run spills), what stays in
    memory even then (`resident`: probe log-probabilities, kept float figures), its stages' peaks while a decoder
    layer is in memory beside them (`with_layer`: the layer's FFN inputs, a backward pass through it) and while it
    is not (`stages`: a layer's quantization), by name, and what it holds only beside a resident model
    (`resident_extra`). `plan_memory` turns it into a `MemoryPlan`; `tokens_flag` words its refusal."""

    calibration: int
    evaluation: int
    resident: int
    stages: Mapping[str, int]
    with_layer: Mapping[str, int]
    batch_tokens: int
    tokens_flag: str = "--calib-tokens/--eval-tokens"
    resident_extra: int = 0  # held only when the model is resident (a plan then scores every layer at once)
    resident_models: int = 0  # other copies of the model beside a resident one (where the engine computes)


def profile_needs(info: ModelInfo, *, calib_tokens: int, n_layers: int, batch_tokens: int = 512) -> Needs:
    """What `profile --model` holds (`hf.layerwise.calibrate_layerwise`): the calibration hidden states; per
    selected layer its FFN inputs, then its FFN and the tensors it is loaded from, one batch observed."""
    spec, d = info.spec, info.spec.d_model
    work = 2 * spec.n_params * 4 + calib_tokens * d * 4 + 8 * batch_tokens * spec.d_ff * 4
    return Needs(calib_tokens * d * 4, 0, 0, {"a layer's calibration": work}, {"its FFN inputs": calib_tokens * d * 4},
                 batch_tokens, "--model-tokens")


def quantize_needs(info: ModelInfo, *, calib_tokens: int, eval_tokens: int, n_layers: int, ablation: bool = False,
                   hessians: bool = False, onnx: bool = False, batch_tokens: int = 512) -> Needs:
    """What `quantize --model` holds (`hf.layerwise.quantize_layerwise`): the calibration and held-out streams
    (float, quantized and, with `ablation`, one per selected layer); per layer its FFN inputs, then its
    quantization: the FFN, the quantized copy and the fake quantization's temporaries of a weight (x 11 with the
    ONNX export and onnxruntime's scoring), the activations, GPTQ's float64 input Hessians (`hessians`)."""
    spec, d = info.spec, info.spec.d_model
    tokens = calib_tokens + eval_tokens
    streams = 2 + (n_layers if ablation and n_layers > 1 else 0)
    work = (11 if onnx else 4) * spec.n_params * 4 + (2 * d + 3 * spec.d_ff) * tokens * 4
    work += 8 * (d * d + spec.d_ff * spec.d_ff) if hessians else 0
    return Needs(calib_tokens * d * 4, streams * eval_tokens * d * 4, 0, {"a layer's quantization": work},
                 {"its FFN inputs": tokens * d * 4}, batch_tokens)


def plan_memory(info: ModelInfo, needs: Needs, *, max_memory: int | None = None, sequential: bool | None = None,
                spill: bool | None = None, spill_dir: str | os.PathLike | None = None,
                device: Any = None) -> MemoryPlan:
    """How `hf.stream.SequentialModel` runs `info` for a task that holds `needs`, under `max_memory` bytes of host
    memory (default: what this process holds plus what the machine has available): the whole model resident, or a
    decoder layer at a time with the kept tensors in memory or spilled to disk. The engine's own stages (the
    embedding read, one layer on a batch, the head with a batch's logits) join the task's. On a GPU (`device`,
    default `infra.device.current_device()`) the model and those stages are counted against the device's free
    memory, and the host holds what is kept. `sequential` None streams only when the whole model does not fit;
    `spill` None spills only when the kept tensors do not fit. Raises a one-line FFNQuantError with the numbers
    when nothing fits, suggesting fewer tokens by `needs.tokens_flag`."""
    # Estimates from the shapes, with factors measured on benchmarks/scale.py's 3B Llama (reports/scale/).
    d, vocab_size = info.spec.d_model, int(info.config.get("vocab_size") or 0)
    # a draft model's target (`--target-model`) is held whole beside it, in float32
    base = process_rss() + _RUNTIME_BYTES + target_bytes(needs.batch_tokens)
    limit = memory_limit(max_memory)
    batch = needs.batch_tokens * d * 4 * 3  # a batch read, its output, the layer's temporaries
    layer = largest_layer_bytes(info)
    vocab = vocab_size * d * 4  # one vocabulary matrix: the embedding, or the head
    logits = 6 * needs.batch_tokens * vocab_size * 4  # a batch's logits, in float32 and float64
    beside_layer = batch + max(needs.with_layer.values(), default=0)
    task = max(needs.stages.values(), default=0)
    # a layer at a time: the embedding (and a chunk of it read), one layer, the head are each read in turn
    streamed_peak = max(vocab + min(vocab // 2, _READ_BYTES) + batch, layer + beside_layer, vocab + logits, task)
    resident_peak = max(beside_layer, logits, task)  # beside the whole model
    kept = needs.calibration + needs.evaluation
    model = info.n_params_total * 4
    device = torch.device(device) if device is not None else current_device()
    dev: dict[str, Any] = {}
    if device.type == "cpu":
        streamed = base + streamed_peak + needs.resident + kept
        spilled = base + streamed_peak + needs.resident
        in_memory = base + model + resident_peak + needs.resident + kept + needs.resident_extra + needs.resident_models
    else:  # the model(s) and every stage's work on the device; kept tensors in host memory, where each tensor
        # read is converted before it moves (the embedding a chunk at a time; a layer's largest tensor, an FFN
        # matrix, under a third of the layer), and where transformers loads a resident model before it moves (its
        # float32 copy is freed before anything is kept)
        read = min(vocab, _READ_BYTES) + layer // 3
        streamed = base + read + needs.resident + kept
        spilled = base + read + needs.resident
        in_memory = base + max(model, needs.resident + kept + needs.resident_extra)
        dev = dict(device=str(device), device_limit=device_free_memory(device),
                   device_in_memory=model + needs.resident_models + resident_peak, device_streamed=streamed_peak)
    largest = max([("the embedding", vocab), ("one decoder layer", layer + beside_layer), ("the head", vocab + logits),
                   *needs.stages.items()], key=lambda kv: kv[1])
    detail = (f"{human_bytes(layer)} for one decoder layer in float32, {human_bytes(largest[1])} for its largest "
              f"stage ({largest[0]})" + (f", {human_bytes(needs.resident)} kept in memory" if needs.resident else "")
              + f", {human_bytes(base)} runtime")
    return choose_memory_plan(info, MemoryPlan(False, False, limit, in_memory, streamed, spilled, layer,
                                               needs.calibration, needs.evaluation, "", **dev),
                              max_memory=max_memory, sequential=sequential, spill=spill, spill_dir=spill_dir,
                              tokens_flag=needs.tokens_flag, detail=detail, spill_bytes=kept + batch)


# `export --model --plan` holds the whole model (`deploy.planned.build_planned_model`): the float model, the float
# FFNs quantized from, their quantized copies, the planned model and the proof's load of the written folder.
# Measured peaks (benchmarks/export_memory.py: ru_maxrss, w4a16 plans, 256 + 128 tokens; each quantized weight held
# once, in the dtype its FFN computes in, its codes in int8): a 0.36B-parameter dense Llama (1.4 GB in float32)
# 5.9 GB, 3.8x its float32 bytes past the runtime; one Qwen3-MoE layer at Qwen3-30B-A3B's widths, where each
# expert's float FFN and its quantized copy come beside the fused tensors, 5.2 GB with 32 experts (0.17B
# parameters) and 17.6 GB with 128 (0.62B): 4x the model and 3.5x its experts again, a little over each.
_EXPORT_MODEL_FACTOR, _EXPORT_EXPERTS_FACTOR = 4.0, 3.5


def export_peak(info: ModelInfo) -> int:
    """The estimated peak host memory of exporting `info` as planned (the whole model in memory; a draft model's
    target beside it)."""
    experts = sum(info.spec.n_params for layer in info.layers if layer.expert is not None)
    return process_rss() + _RUNTIME_BYTES + target_bytes() + int(4 * (_EXPORT_MODEL_FACTOR * info.n_params_total
                                                                      + _EXPORT_EXPERTS_FACTOR * experts))


def export_memory_refusal(info: ModelInfo, max_memory: int | None = None) -> str | None:
    """Why exporting `info` would not fit the memory budget (--max-memory, or what the process holds plus what the
    machine has available), or None: checked before the model is read, instead of a run the kernel kills."""
    limit = memory_limit(max_memory)
    need = export_peak(info)
    if limit is None or need <= limit:
        return None
    budget = "--max-memory" if max_memory is not None else "available on this machine"
    return (f"{info.path}: export holds the whole model in memory (its float32 weights about "
            f"{_EXPORT_MODEL_FACTOR}x over, routed experts {_EXPORT_EXPERTS_FACTOR}x more): an estimated "
            f"{human_bytes(need)}, more than the {human_bytes(limit)} {budget}; plan and quantize read a decoder layer "
            "at a time, export does not yet: export on a machine with more memory, or give a larger --max-memory "
            "to try anyway")


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
    limit, in_memory, streamed, spilled = estimate.limit, estimate.in_memory, estimate.streamed, estimate.spilled
    calibration, evaluation = estimate.calibration, estimate.evaluation

    def plan(seq: bool, spl: bool, reason: str) -> MemoryPlan:
        return replace(estimate, sequential=seq, spill=spl, reason=reason)

    why_not = streamable_reason(info)
    dev_limit, on = estimate.device_limit, estimate.device
    dev_fits = dev_limit is None or estimate.device_in_memory is None or estimate.device_in_memory <= dev_limit
    fits = (limit is None or in_memory <= limit) and dev_fits
    if sequential is False or (sequential is None and (fits or why_not)):
        if not dev_fits and (sequential is False or why_not):
            hint = f" ({why_not})" if why_not else (f"; streamed layer by layer it would need "
                                                    f"{human_bytes(estimate.device_streamed)} there")
            raise FFNQuantError(f"{info.path}: the whole model in float32 and its work need about "
                                f"{human_bytes(estimate.device_in_memory)} on {on}, over the {human_bytes(dev_limit)} "
                                f"free there{hint}: use --device cpu" + ("" if why_not else " or leave out --no-sequential"))
        if not fits and (sequential is False or max_memory is not None):
            hint = f"; streamed layer by layer it would need {human_bytes(streamed)}" if not why_not else f" ({why_not})"
            raise FFNQuantError(f"{info.path}: the whole model in float32 needs about {human_bytes(in_memory)}, over "
                                f"the {human_bytes(limit)} memory budget{hint}: use a larger --max-memory"
                                + ("" if why_not else " or leave out --no-sequential"))
        return plan(False, False, "--no-sequential" if sequential is False else "it fits")
    if why_not:
        raise FFNQuantError(f"{info.path}: --sequential: {why_not}")
    if dev_limit is not None and estimate.device_streamed is not None and estimate.device_streamed > dev_limit:
        raise FFNQuantError(f"{info.path}: layer by layer this run needs about {human_bytes(estimate.device_streamed)} "
                            f"on {on} ({detail}), over the {human_bytes(dev_limit)} free there: pass fewer "
                            f"{tokens_flag} or use --device cpu")
    reason = "--sequential" if sequential else (
        f"the whole model needs about {human_bytes(estimate.device_in_memory)} on {on}" if not dev_fits
        else f"the whole model needs about {human_bytes(in_memory)}")
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


