"""A planned model as one ONNX graph: the causal LM exported whole (prefill, no KV cache), its FFN matmuls
rewritten as the plan quantized them, scored and timed on onnxruntime's CPU provider.

The graph is exported from `PlannedModel.model` (input scales folded into the norms, ffnquant's dequantized
FFN weights), so every FFN weight in it already lies on its grid: the rewrite recovers the integer codes from
the `ModuleQuant` grids and never quantizes anything again. Per FFN matmul:

- int8 weights, static input: QDQ as `onnxquant.write_qdq` writes it (the calibrated SiteRange on the input,
  int8 codes and per-channel DequantizeLinear on the weight); onnxruntime fuses it into integer matmuls.
- int8 weights, dynamic input: ffnquant's per-token range computed with ONNX ops (ReduceMin/Max, Round,
  Clip), the codes multiplied in MatMulInteger (exact int32 sums), then scaled per token and per channel.
  onnxruntime's DynamicQuantizeLinear is per tensor, which is not ffnquant's numerics.
- int8 weights, float input (w8a16): the weight's DequantizeLinear only.
- 4-bit group weights, float input: MatMulNBits with the grid's codes (`onnxquant._nbits_node`).
- a block-Hadamard rotation on the hidden site: a MatMul by the block before w_down (w_down carries it).
- float weights and input: the exported MatMul, untouched.
fp8 grids, llm-int8's outlier split and 4-bit weights with quantized inputs are refused with the reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import io
import logging
import math
import os
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import FFNQuantError, first_line
from ..export import DEFAULT_OPSET

__all__ = [
    "PPL_TOLERANCE",
    "graph_refusal",
    "module_kind",
    "float_tolerance",
    "export_float_graph",
    "quantize_graph",
    "score_graph",
    "graph_latency",
    "write_model_graph",
]

# The requirement: the graph's perplexity within 0.5% (relative) of ffnquant's torch reference.
PPL_TOLERANCE = 0.005
# One ONNX file is one protobuf message, which cannot exceed 2 GiB; larger models need external data files,
# which this writer does not produce (every model it takes fits, so one self-contained file is the format).
PROTOBUF_LIMIT = 2**31
# Peak memory of writing the graph, in fp32 weight copies: the exported proto, its serialization (check and
# save), the float graph loaded again for the rewrite, and two onnxruntime sessions (weights plus prepacked).
EXPORT_COPIES = 5
_MS_DOMAIN = "com.microsoft"
_EXACT_WEIGHT_ONLY = "session.qdq_matmulnbits_accuracy_level"
OUTPUTS = ("logits", "last_hidden")


def graph_refusal(info: Any) -> str | None:
    """Why `info`'s model cannot be written as one ONNX graph here (one line); None when it can."""
    from ..hf.arch import ModelKind
    from ..resources import available_memory, human_bytes
    from .planned import deployable_refusal

    if info.kind is not ModelKind.CAUSAL_LM:
        return f"{info.model_type}: the whole-model graph is written for causal LMs (logits), not {info.kind.value} models"
    why = deployable_refusal(info)
    if why is not None:
        return why
    weights = 4 * int(info.n_params_total)
    # the exporter may store a tied embedding twice: [V, d] for the lookup, transposed for the logits
    tied = 4 * int(info.config.get("vocab_size") or 0) * info.spec.d_model if info.config.get("tie_word_embeddings") else 0
    if weights + tied >= PROTOBUF_LIMIT:
        return (f"{info.model_type}: its fp32 graph would hold {human_bytes(weights + tied)} of weights, over the 2 GiB "
                "a single ONNX protobuf can hold; external-data graphs are not written")
    have = available_memory()
    if have is not None and EXPORT_COPIES * weights > have:
        return (f"{info.model_type}: writing its graph takes about {human_bytes(EXPORT_COPIES * weights)} "
                f"({EXPORT_COPIES} fp32 copies of {human_bytes(weights)}); this machine has {human_bytes(have)} available")
    return None


# --- what each FFN matmul becomes --------------------------------------------------------------------

def module_kind(m: Any) -> str:
    """What the graph writes for one `ModuleQuant`: 'float', 'act-qdq', 'qdq', 'weight-dq', 'dynamic-int8' or
    'nbits'; FFNQuantError (one line naming the recipe) for what has no honest graph here."""
    from ..schemes import ActDType

    scheme, grid, mode = m.scheme, m.grid, m.input_mode
    where = f"{m.module} (recipe {m.recipe})"
    if (grid is not None and grid.kind == "fp8") or (mode is not None and scheme.act_dtype is ActDType.FP8_E4M3):
        raise FFNQuantError(f"{where}: fp8 e4m3 has no onnxruntime CPU matmul kernel (float8 Quantize/DequantizeLinear "
                            "would only emulate it in float); no graph is written")
    if grid is not None and grid.kind != "int":
        raise FFNQuantError(f"{where}: {grid.kind} weight grids have no ONNX writer")
    if mode == "static":
        r = m.input_range
        if r is None or (r.qmin, r.qmax) not in ((0, 255), (-128, 127)):
            raise FFNQuantError(f"{where}: static inputs are written as uint8 or int8 QuantizeLinear, "
                                f"not the range {None if r is None else (r.qmin, r.qmax)}")
    if grid is None:
        if mode == "dynamic":
            raise FFNQuantError(f"{where}: per-token inputs are written for int8 weights only (MatMulInteger)")
        return "act-qdq" if mode == "static" else "float"
    if grid.bits == 4:
        if mode is not None:
            raise FFNQuantError(f"{where}: MatMulNBits takes float activations; 4-bit weights with {mode} "
                                "quantized inputs have no onnxruntime kernel")
        g = grid.group_size or 0
        if g < 16 or g & (g - 1):
            raise FFNQuantError(f"{where}: MatMulNBits blocks are powers of two >= 16, the grid's groups are {g} wide")
        return "nbits"
    if grid.bits != 8 or grid.granularity not in ("per_channel", "per_tensor"):
        raise FFNQuantError(f"{where}: {grid.bits}-bit {grid.granularity} integer weights have no ONNX writer "
                            "(int8 per channel or per tensor, 4-bit groups)")
    if mode == "dynamic":
        if scheme.outlier_threshold is not None:
            raise FFNQuantError(f"{where}: llm-int8's outlier split (float columns above {scheme.outlier_threshold}) "
                                "has no ONNX graph; no graph is written")
        if bool(torch.any(grid.zero_point != 0)):
            raise FFNQuantError(f"{where}: per-token int8 inputs are written with symmetric int8 weights only")
        return "dynamic-int8"
    return "qdq" if mode == "static" else "weight-dq"


def _codes(m: Any, w: torch.Tensor) -> torch.Tensor:
    """The integer codes of the planned weight `w` [out, in] on its grid (signed, int32; [out, K'] for groups),
    checked to give `w` back: the grid is what the model was quantized to, so any miss means a wrong graph."""
    grid = m.grid
    scale, zp = grid.scale.float(), grid.zero_point.to(torch.int32)
    out_f, in_f = w.shape
    if grid.granularity == "per_group":
        g = grid.group_size
        groups = scale.shape[1]
        w = torch.cat([w, w.new_zeros(out_f, groups * g - in_f)], 1)  # padded columns: code = zero point
        scale, zp = scale.repeat_interleave(g, 1), zp.repeat_interleave(g, 1)
    else:
        scale, zp = scale.reshape(-1, 1) if scale.ndim else scale, zp.reshape(-1, 1) if zp.ndim else zp
    q = torch.clamp(torch.round(w / scale) + zp, grid.qmin, grid.qmax).to(torch.int32)
    back = ((q - zp).float() * scale)[:, :in_f]
    err = float((back - w[:, :in_f]).abs().max())
    # exactly on the grid: (code - zp) * scale is the very product that made the weight
    if err > 1e-6 * float(scale.abs().max()):
        raise FFNQuantError(f"{m.module}: the model's weight is not on its {grid.bits}-bit grid (off by {err:.3g}); "
                            "was it built by build_planned_model?")
    return q


# --- export ------------------------------------------------------------------------------------------

class _Prefill(nn.Module):
    """The causal LM as the graph computes it: token ids -> (logits, final hidden state), no KV cache."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=input_ids, use_cache=False, output_hidden_states=True, return_dict=True)
        return out.logits, out.hidden_states[-1]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # the exporter logs a warning per missing torchvision op and prints progress: nothing about this model
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def float_tolerance(ref_absmax: float, n_layers: int, width: int) -> float:
    """How far onnxruntime's fp32 graph may be from torch's: each length-`width` dot product summed in another
    order differs by ~sqrt(width) units of float32 roundoff (2^-24) of its magnitude, the blocks add theirs
    (residual stream), and 8x covers softmax/norm amplification; scaled by the output's magnitude (>= 1)."""
    return 8.0 * n_layers * math.sqrt(width) * 2.0**-24 * max(1.0, float(ref_absmax))


def _parity(model: nn.Module, info: Any, path: Path, ids: torch.Tensor) -> dict[str, Any]:
    from ..onnxquant import ort_session

    session = ort_session(path)
    got = session.run(list(OUTPUTS), {"input_ids": ids.numpy().astype(np.int64)})
    with torch.no_grad():
        ref = [t.float().numpy() for t in _Prefill(model)(ids)]
    width = max(info.spec.d_model, info.spec.d_ff)
    out = {"shape": list(ids.shape), "provider": session.get_providers()[0], "passed": True}
    for name, g, r in zip(OUTPUTS, got, ref):
        if g.shape != r.shape:
            raise FFNQuantError(f"{path}: {name} has shape {g.shape} on onnxruntime, {r.shape} in torch")
        err, tol = float(np.abs(g - r).max()), float_tolerance(np.abs(r).max(), info.n_layers, width)
        out[name] = {"max_abs_error": err, "ref_absmax": float(np.abs(r).max()), "tolerance": tol}
        out["passed"] &= err <= tol
    return out


def _export(model: nn.Module, info: Any, path: str | os.PathLike, opset: int, ids: torch.Tensor | None) -> dict[str, Any]:
    import onnx

    from ..atomic import atomic_path

    model = model.eval()
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    example = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    if "dynamo" not in inspect.signature(torch.onnx.export).parameters:
        raise FFNQuantError(f"torch {torch.__version__} has no dynamo ONNX exporter (torch >= 2.5 exports whole models)")
    with _quiet(), torch.no_grad():
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        try:
            program = torch.onnx.export(_Prefill(model), (example,), dynamo=True, opset_version=opset,
                                        dynamic_shapes={"input_ids": {0: batch, 1: seq}}, input_names=["input_ids"],
                                        output_names=list(OUTPUTS), verbose=False)
        except Exception as exc:  # the exporter's own (long, multi-line) report of an op or pattern it cannot take
            raise FFNQuantError(f"{info.model_type}: torch.onnx could not export the model: {first_line(exc)}") from exc
        proto = program.model_proto
        del program
    proto.ir_version = min(proto.ir_version, 10)  # onnxruntime reads IR <= 10
    onnx.helper.set_model_props(proto, {"ffnquant_graph": "fp32", "model_type": info.model_type,
                                        "exporter": "torch.onnx dynamo"})
    onnx.checker.check_model(proto, full_check=True)
    if ids is None:
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with atomic_path(path) as tmp:  # checked before it takes the name: a failed parity leaves no file
        onnx.save_model(proto, str(tmp))
        del proto
        parity = _parity(model, info, tmp, ids)
        if not parity["passed"]:
            worst = max(OUTPUTS, key=lambda k: parity[k]["max_abs_error"] / parity[k]["tolerance"])
            raise FFNQuantError(f"{path}: the fp32 graph's {worst} differs from torch by "
                                f"{parity[worst]['max_abs_error']:.3g} (tolerance {parity[worst]['tolerance']:.3g})")
    return parity


def export_float_graph(model: nn.Module, info: Any, path: str | os.PathLike, opset: int = DEFAULT_OPSET,
                       ids: torch.Tensor | None = None) -> Path:
    """`model` (a transformers causal LM) as one fp32 ONNX graph: input `input_ids` [batch, seq] (dynamic),
    outputs `logits` and `last_hidden` (hidden_states[-1]); prefill only, no KV cache. Checked on onnxruntime
    against torch on `ids` (default a random [2, 16] batch); FFNQuantError when they differ (`float_tolerance`)."""
    _export(model, info, path, opset, ids)
    return Path(path)


# --- the rewrite -------------------------------------------------------------------------------------

def _find_matmuls(proto: Any, planned: Any) -> dict[str, tuple[Any, Any]]:
    """{module: (MatMul node, its [in, out] weight initializer)}, matched by value with the planned model's
    weights (the exporter names initializers val_N): robust to names, exact because the export copies them."""
    from onnx import numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    uses = Counter(x for n in proto.graph.node for x in n.input)
    by_hash: dict[str, list[tuple[Any, Any]]] = {}
    for node in proto.graph.node:
        if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in inits:
            arr = numpy_helper.to_array(inits[node.input[1]])
            if arr.ndim == 2 and arr.dtype == np.float32:
                key = hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()
                by_hash.setdefault(key, []).append((node, inits[node.input[1]]))
    found, missing = {}, []
    for m in planned.modules:
        w = planned.model.get_submodule(m.module).weight.detach().float().T.contiguous().numpy()
        hits = by_hash.get(hashlib.sha1(w.tobytes()).hexdigest(), [])
        if len(hits) != 1:
            if hits:
                raise FFNQuantError(f"{m.module}: its weight is the weight of {len(hits)} matmuls in the graph; cannot tell "
                                    "which one is this FFN's")
            missing.append(m.module)
            continue
        node, init = hits[0]
        if uses[init.name] != 1:
            raise FFNQuantError(f"{m.module}: its weight initializer feeds {uses[init.name]} nodes; a shared weight "
                                "cannot be rewritten for one of them")
        found[m.module] = hits[0]
    if missing:
        raise FFNQuantError(f"could not find the matmul(s) of {', '.join(missing[:3])}"
                            f"{' and more' if len(missing) > 3 else ''} in the graph (weights not stored as [in, out] "
                            "MatMul initializers)")
    return found


class _Rewriter:
    """Collects the nodes and initializers of the rewrite; shared inputs (w_gate and w_up) are quantized once."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.before: dict[int, list] = {}  # id(consumer node) -> nodes to insert before it
        self.replace: dict[int, list] = {}  # id(node) -> nodes in its place
        self.inits: list = []
        self.shared: dict[tuple, str] = {}
        self.removed: set[str] = set()

    def const(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def node(self, consumer: Any, op: str, inputs: Sequence[str], output: str, **attrs: Any) -> str:
        from onnx import helper

        self.before.setdefault(id(consumer), []).append(
            helper.make_node(op, list(inputs), [output], name=f"{output}_{op}", **attrs))
        return output

    def rotate(self, x: str, consumer: Any, rot: Any) -> str:
        """x [b, s, f] -> x Q, Q = blockdiag(H): reshaped to (f/b, b) blocks as `BlockHadamard.forward` does it
        (a [f, f] matmul would cost more than w_down itself)."""
        key = ("rotate", x)
        if key not in self.shared:
            f, b = rot.features, rot.block
            blocks = self.node(consumer, "Reshape", [x, self.const(f"{x}_rot_shape", np.array([0, 0, f // b, b], np.int64))],
                               f"{x}_rot_blocks")
            turned = self.node(consumer, "MatMul", [blocks, self.const(f"{x}_rot_h", rot.h.float().numpy())], f"{x}_rot_mm")
            self.shared[key] = self.node(consumer, "Reshape", [turned, self.const(f"{x}_rot_back",
                                                                                  np.array([0, 0, f], np.int64))], f"{x}_rot")
        return self.shared[key]

    def static_qdq(self, x: str, consumer: Any, r: Any) -> str:
        key = ("qdq", x, r.scale, r.zero_point, r.qmin)
        if key not in self.shared:
            np_t = np.uint8 if r.qmin == 0 else np.int8
            s = self.const(f"{x}_scale", np.array(r.scale, np.float32))
            z = self.const(f"{x}_zero_point", np.array(r.zero_point, np_t))
            q = self.node(consumer, "QuantizeLinear", [x, s, z], f"{x}_quantized")
            self.shared[key] = self.node(consumer, "DequantizeLinear", [q, s, z], f"{x}_dequantized")
        return self.shared[key]

    def weight_dq(self, m: Any, consumer: Any, q: torch.Tensor, prefix: str) -> str:
        codes = self.const(f"{prefix}_quantized", q.T.contiguous().numpy().astype(np.int8))  # [in, out]
        if m.grid.granularity == "per_channel":  # output channels are the columns of the [in, out] codes
            s = self.const(f"{prefix}_scale", m.grid.scale.reshape(-1).float().numpy())
            z = self.const(f"{prefix}_zero_point", m.grid.zero_point.reshape(-1).numpy().astype(np.int8))
            return self.node(consumer, "DequantizeLinear", [codes, s, z], f"{prefix}_dequantized", axis=1)
        s = self.const(f"{prefix}_scale", np.array(float(m.grid.scale), np.float32))
        z = self.const(f"{prefix}_zero_point", np.array(int(m.grid.zero_point), np.int8))
        return self.node(consumer, "DequantizeLinear", [codes, s, z], f"{prefix}_dequantized")

    def per_token(self, x: str, consumer: Any, scheme: Any) -> tuple[str, str, str | None]:
        """ffnquant's per-token quantization (`primitives.fake_quantize_per_token`, `choose_qparams`) as ONNX ops:
        (codes, scale [b, s, 1], zero point [b, s, 1] or None when symmetric)."""
        from ..schemes import ActDType
        from onnx import TensorProto

        key = ("token", x)
        if key in self.shared:
            return self.shared[key]
        signed = scheme.act_dtype is ActDType.INT8
        symmetric = bool(scheme.act_symmetric)
        qmin, qmax = (-128, 127) if signed else (0, 255)
        f32 = lambda name, v: self.const(f"{x}_{name}", np.array(v, np.float32))  # noqa: E731
        axes = self.const(f"{x}_token_axes", np.array([-1], np.int64))
        zero = f32("zero", 0.0)
        lo = self.node(consumer, "Min", [self.node(consumer, "ReduceMin", [x, axes], f"{x}_tmin", keepdims=1), zero], f"{x}_lo")
        hi = self.node(consumer, "Max", [self.node(consumer, "ReduceMax", [x, axes], f"{x}_tmax", keepdims=1), zero], f"{x}_hi")
        if symmetric:
            zp_value = (qmin + qmax + 1) // 2
            amax = self.node(consumer, "Max", [self.node(consumer, "Neg", [lo], f"{x}_neglo"), hi], f"{x}_amax")
            raw = self.node(consumer, "Div", [amax, f32("steps", float(qmax - zp_value))], f"{x}_raw_scale")
        else:
            raw = self.node(consumer, "Div", [self.node(consumer, "Sub", [hi, lo], f"{x}_span"),
                                              f32("steps", float(qmax - qmin))], f"{x}_raw_scale")
        # choose_qparams: a zero range gets scale 1, a subnormal one float32's smallest normal step
        pos = self.node(consumer, "Greater", [raw, zero], f"{x}_scale_pos")
        tiny = self.node(consumer, "Max", [raw, f32("tiny", np.finfo(np.float32).tiny)], f"{x}_scale_tiny")
        scale = self.node(consumer, "Where", [pos, tiny, f32("one", 1.0)], f"{x}_token_scale")
        lo_q, hi_q = f32("qmin", float(qmin)), f32("qmax", float(qmax))
        rounded = self.node(consumer, "Round", [self.node(consumer, "Div", [x, scale], f"{x}_scaled")], f"{x}_rounded")
        zp = None
        if symmetric:
            if zp_value:  # uint8 symmetric: the fixed zero point 128, taken off like an asymmetric one
                zp = f32("zp", float(zp_value))
                rounded = self.node(consumer, "Add", [rounded, zp], f"{x}_shifted")
        else:
            zp = self.node(consumer, "Clip", [self.node(consumer, "Round", [self.node(
                consumer, "Neg", [self.node(consumer, "Div", [lo, scale], f"{x}_lo_scaled")], f"{x}_lo_neg")],
                f"{x}_zp_round"), lo_q, hi_q], f"{x}_token_zp")
            rounded = self.node(consumer, "Add", [rounded, zp], f"{x}_shifted")
        clipped = self.node(consumer, "Clip", [rounded, lo_q, hi_q], f"{x}_clipped")
        codes = self.node(consumer, "Cast", [clipped], f"{x}_codes", to=TensorProto.INT8 if signed else TensorProto.UINT8)
        self.shared[key] = (codes, scale, zp)
        return self.shared[key]

    def dynamic_matmul(self, m: Any, node: Any, q: torch.Tensor, prefix: str) -> None:
        """Per-token codes x int8 weight codes in MatMulInteger (exact int32), then x token scale x channel scale;
        an asymmetric token zero point comes off as zp * (column sums of the codes), exact in int32."""
        from onnx import TensorProto, helper

        codes, scale, zp = self.per_token(node.input[0], node, m.scheme)
        wq = self.const(f"{prefix}_quantized", q.T.contiguous().numpy().astype(np.int8))
        acc = self.node(node, "MatMulInteger", [codes, wq], f"{prefix}_int32")
        if zp is not None:
            colsum = self.const(f"{prefix}_colsum", q.sum(1).numpy().astype(np.int32))
            zp_i = self.node(node, "Cast", [zp], f"{prefix}_zp_int32", to=TensorProto.INT32)
            acc = self.node(node, "Sub", [acc, self.node(node, "Mul", [zp_i, colsum], f"{prefix}_zp_cols")],
                            f"{prefix}_int32_centred")
        acc_f = self.node(node, "Cast", [acc], f"{prefix}_acc", to=TensorProto.FLOAT)
        per_token = self.node(node, "Mul", [acc_f, scale], f"{prefix}_token_scaled")
        w_scale = self.const(f"{prefix}_scale", m.grid.scale.reshape(-1).float().numpy())
        self.replace[id(node)] = [helper.make_node("Mul", [per_token, w_scale], list(node.output), name=f"{prefix}_Mul")]

    def finish(self) -> None:
        nodes = list(self.graph.node)
        out = []
        for n in nodes:
            out += self.before.get(id(n), [])
            out += self.replace.get(id(n), [n])
        del self.graph.node[:]
        self.graph.node.extend(out)
        for i in reversed(range(len(self.graph.initializer))):  # by index: remove() compares whole tensors
            if self.graph.initializer[i].name in self.removed:
                del self.graph.initializer[i]
        self.graph.initializer.extend(self.inits)


def quantize_graph(float_path: str | os.PathLike, planned: Any, out_path: str | os.PathLike) -> dict[str, Any]:
    """Rewrite the FFN matmuls of `float_path` (the export of `planned.model`) as `planned.modules` say (module
    docstring) into `out_path`. Every module is checked before the graph is read. Returns what was written per
    module, the op counts before and after, and the files' bytes."""
    import onnx
    from onnx import helper

    from ..onnxquant import _check_and_save, _nbits_node

    kinds = {m.module: module_kind(m) for m in planned.modules}
    proto = onnx.load(str(float_path))
    before = Counter(n.op_type for n in proto.graph.node)
    found = _find_matmuls(proto, planned)
    position = {id(n): i for i, n in enumerate(proto.graph.node)}
    rw = _Rewriter(proto.graph)
    # in graph order: a shared input's quantizer goes before its first reader (w_gate or w_up)
    for m in sorted(planned.modules, key=lambda m: position[id(found[m.module][0])]):
        node, init = found[m.module]
        kind, prefix = kinds[m.module], m.module.replace(".", "_")
        if m.rotation is not None:
            node.input[0] = rw.rotate(node.input[0], node, m.rotation)
        if m.input_mode == "static":
            node.input[0] = rw.static_qdq(node.input[0], node, m.input_range)
        if kind in ("float", "act-qdq"):
            continue
        w = planned.model.get_submodule(m.module).weight.detach().float()
        q = _codes(m, w)
        rw.removed.add(init.name)
        if kind == "dynamic-int8":
            rw.dynamic_matmul(m, node, q, prefix)
        elif kind == "nbits":  # MatMulNBits' unsigned layout: codes and zero points + 8
            g = m.grid.group_size
            blocks = q.shape[1] // g
            new, inits = _nbits_node(node, prefix, q + 8, m.grid.scale.float().reshape(-1, blocks, 1),
                                     (m.grid.zero_point + 8).reshape(-1, blocks, 1), g, m.grid.symmetric, w.shape[1])
            rw.replace[id(node)] = [new]
            rw.inits += inits
        else:
            node.input[1] = rw.weight_dq(m, node, q, prefix)
    rw.finish()
    if "nbits" in kinds.values() and not any(o.domain == _MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    proto.ir_version = min(proto.ir_version, 10)
    props = {**{p.key: p.value for p in proto.metadata_props}, "ffnquant_graph": "quantized"}
    if "weight-dq" in kinds.values():
        # a default session turns DequantizeLinear -> MatMul into MatMulNBits at accuracy level 4, which quantizes
        # the activations on the fly: w8a16 computes what it says only with this entry (onnxquant.ort_session)
        props["ffnquant_session_config"] = f"{_EXACT_WEIGHT_ONLY}=0"
    helper.set_model_props(proto, props)
    after = Counter(n.op_type for n in proto.graph.node)
    _check_and_save(proto, out_path)
    rows = [{"module": m.module, "layer": m.layer, "weight": m.weight, "recipe": m.recipe, "kind": kinds[m.module],
             "rotation": m.rotation is not None} for m in planned.modules]
    return {"path": str(out_path), "modules": rows, "kinds": dict(Counter(kinds.values())),
            "nodes": {"float": dict(before), "quantized": dict(after)},
            "n_nodes": {"float": sum(before.values()), "quantized": sum(after.values())},
            "bytes": {"source": os.path.getsize(float_path), "quantized": os.path.getsize(out_path)}}


# --- measurement -------------------------------------------------------------------------------------

def score_graph(path: str | os.PathLike, planned: Any) -> dict[str, Any]:
    """The graph on onnxruntime's CPU provider over `planned.evals`, against the float model in torch
    (`hf.compare_models`: perplexity, final-hidden SQNR), beside ffnquant's torch reference of the same plan."""
    from ..hf import compare_models
    from ..onnxquant import ort_session

    session = ort_session(path)

    def run(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = session.run(list(OUTPUTS), {"input_ids": ids.numpy().astype(np.int64)})
        return torch.from_numpy(logits), torch.from_numpy(hidden)

    onnx_figures = compare_models(planned.float_model, None, planned.info, planned.evals, candidate_run=run)
    ref = planned.reference["end_to_end"]
    rel = onnx_figures["perplexity"] / ref["perplexity"] - 1.0
    return {"onnx": onnx_figures,
            "reference": {"perplexity": ref["perplexity"], "hidden_sqnr_db": ref.get("hidden_sqnr_db")},
            "perplexity_rel_diff": rel, "tolerance": PPL_TOLERANCE, "meets_tolerance": abs(rel) <= PPL_TOLERANCE,
            "hidden_sqnr_db_diff": onnx_figures["hidden_sqnr_db"] - ref["hidden_sqnr_db"]
            if ref.get("hidden_sqnr_db") is not None else None,
            "provider": session.get_providers()[0], "providers": list(session.get_providers())}


def graph_latency(float_path: str | os.PathLike, quant_path: str | os.PathLike, tokens: Sequence[int] = (1, 512),
                  rounds: int = 5, per_round: int = 1, warmup: int = 1, threads: int | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """Side-by-side latency of the fp32 and quantized graphs on onnxruntime's CPU provider at batch 1 and each
    token count: interleaved rounds (each graph and size in every round, so machine drift hits all alike),
    p10/p50/p90 ms and the speedup (fp32 p50 / quantized p50). Cheap by default; ask for more rounds to publish."""
    from ..latency import latency_stats
    from ..onnxquant import ort_session

    if rounds < 1 or per_round < 1 or warmup < 0 or not tokens or min(tokens) < 1:
        raise FFNQuantError("graph_latency needs rounds >= 1, per_round >= 1, warmup >= 0 and token counts >= 1")
    sessions = {"float": ort_session(float_path, threads=threads), "quantized": ort_session(quant_path, threads=threads)}
    vocab = sessions["float"].get_outputs()[0].shape[-1]
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else 2
    rng = np.random.default_rng(seed)
    inputs = {n: {"input_ids": rng.integers(0, vocab, (1, n), dtype=np.int64)} for n in tokens}
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in sessions for n in tokens}
    for session in sessions.values():  # first runs allocate and pick kernels
        for n in tokens:
            for _ in range(warmup):
                session.run(None, inputs[n])
    for _ in range(rounds):
        for n in tokens:
            for key, session in sessions.items():
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    session.run(None, inputs[n])
                    times[key, n].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"provider": sessions["quantized"].get_providers()[0], "threads": threads or "onnxruntime default",
                           "rounds": rounds, "per_round": per_round, "batch": 1, "tokens": {}}
    for n in tokens:
        row = {}
        for key in sessions:
            s = latency_stats(times[key, n])
            row[key] = {"p10_ms": s.p10_s * 1e3, "p50_ms": s.median_s * 1e3, "p90_ms": s.p90_s * 1e3, "samples": s.n}
        row["speedup"] = row["float"]["p50_ms"] / row["quantized"]["p50_ms"]
        out["tokens"][str(n)] = row
    return out


def write_model_graph(planned: Any, folder: str | os.PathLike, *, opset: int = DEFAULT_OPSET,
                      tokens: Sequence[int] = (1, 512), rounds: int = 5) -> dict[str, Any]:
    """The planned model as ONNX in `folder`: `model.fp32.onnx` (the float model, the latency baseline) and
    `model.onnx` (the quantized graph), scored and timed; JSON-able. Single files: `graph_refusal` refuses
    models whose graph would need external data. The caller stages `folder`."""
    import onnxruntime as ort

    why = graph_refusal(planned.info)
    if why is not None:
        raise FFNQuantError(why)
    for m in planned.modules:  # refuse before minutes of exporting
        module_kind(m)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fp32, quant = folder / "model.fp32.onnx", folder / "model.onnx"
    ids = planned.evals[0][:1, :64] if planned.evals else None
    parity = _export(planned.float_model, planned.info, fp32, opset, ids)
    with tempfile.TemporaryDirectory(prefix=".ffnquant-graph-", dir=folder) as tmp:
        # the rewrite starts from the planned model's own export: its weights are the grids' values
        planned_fp32 = Path(tmp) / "planned.fp32.onnx"
        planned_parity = _export(planned.model, planned.info, planned_fp32, opset, ids)
        written = quantize_graph(planned_fp32, planned, quant)
    score = score_graph(quant, planned)
    latency = graph_latency(fp32, quant, tokens=tokens, rounds=rounds)
    return {"files": {fp32.name: fp32.stat().st_size, quant.name: quant.stat().st_size}, "external_data": False,
            "opset": opset, "parity": {"float": parity, "planned": planned_parity}, "quantize": written,
            "score": score, "latency": latency, "onnxruntime": ort.__version__, "providers": score["providers"]}
