"""The ONNX nodes of a quantized matmul, written once: for one FFN's artifact (`onnxquant`) and for a whole
model's graph (`deploy.onnx_rewrite`).

`matmul_kind` says what a matmul becomes from its weight grid and input quantizer (or why onnxruntime has no
honest graph for it); `MatmulRewriter` writes it from the method handler's own codes (`QuantizedLinear.codes`),
never quantizing a weight again: a static input's QuantizeLinear/DequantizeLinear (shared by the matmuls that
read one tensor), an int8 weight's DequantizeLinear, per-token int8 inputs with MatMulInteger, MatMulNBits for
4-bit groups (`nbits_node`), and a block-Hadamard rotation of the input.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ..errors import FFNQuantError
from ..infra.atomic import atomic_path
from ..numerics import primitives as P
from ..schemes import ActDType

if TYPE_CHECKING:  # annotations only
    from ..methods.qlinear import WeightGrid
    from ..schemes import Scheme

__all__ = ["MS_DOMAIN", "EXACT_WEIGHT_ONLY", "matmul_kind", "MatmulRewriter", "nbits_node", "bnb4_node", "write_matmul",
           "check_and_save"]

MS_DOMAIN = "com.microsoft"
# onnxruntime's session option that keeps MatMulNBits / weight-only DQ in float (its default quantizes inputs)
EXACT_WEIGHT_ONLY = "session.qdq_matmulnbits_accuracy_level"


def matmul_kind(scheme: Scheme, grid: WeightGrid, mode: str | None, input_range: Any, where: str) -> str:
    """What one quantized matmul becomes: 'float', 'act-qdq' (a static input, float weights), 'qdq', 'weight-dq',
    'dynamic-int8' (per-token MatMulInteger) or 'nbits'; FFNQuantError (one line starting with `where`) for what
    has no honest onnxruntime graph. `grid` is the weight's (None: float), `mode` the input's ('static',
    'dynamic' or None) with its static `input_range`."""
    if (grid is not None and grid.kind == "fp8") or (mode is not None and scheme.act_dtype is ActDType.FP8_E4M3):
        raise FFNQuantError(f"{where}: fp8 e4m3 has no onnxruntime CPU matmul kernel (float8 Quantize/DequantizeLinear "
                            "would only emulate it in float); no graph is written")
    if grid is not None and grid.kind != "int":
        raise FFNQuantError(f"{where}: {grid.kind} weight grids have no ONNX writer")
    if mode == "static":
        r = input_range
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



class MatmulRewriter:
    """Collects the nodes and initializers of the rewrite; shared inputs (w_gate and w_up) are quantized once, and a
    weight several MatMuls read (a looped depth's later calls of one FFN) is stored once: an initializer added again
    under its name is the same one, a weight's DequantizeLinear made once."""

    def __init__(self, graph: Any) -> None:
        self.graph = graph
        self.before: dict[int, list] = {}  # id(consumer node) -> nodes to insert before it
        self.replace: dict[int, list] = {}  # id(node) -> nodes in its place
        self.inits: list = []
        self.shared: dict[tuple, str] = {}
        self.removed: set[str] = set()
        self.names: set[str] = set()  # the initializers added

    def const(self, name: str, value: np.ndarray) -> str:
        from onnx import numpy_helper

        if name not in self.names:
            self.add([numpy_helper.from_array(value, name)])
        return name

    def add(self, inits: Sequence[Any]) -> None:
        """Initializers, each once by name (a weight's codes for every MatMul reading it)."""
        for init in inits:
            if init.name not in self.names:
                self.names.add(init.name)
                self.inits.append(init)

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

    def weight_dq(self, grid: WeightGrid, consumer: Any, q: torch.Tensor, prefix: str) -> str:
        """int8 codes [out, in] on `grid` (signed) as a DequantizeLinear of an [in, out] initializer (made before its
        first consumer, read by every one)."""
        key = ("weight_dq", prefix)
        if key not in self.shared:
            self.shared[key] = self._weight_dq(grid, consumer, q, prefix)
        return self.shared[key]

    def _weight_dq(self, grid: WeightGrid, consumer: Any, q: torch.Tensor, prefix: str) -> str:
        codes = self.const(f"{prefix}_quantized", q.T.contiguous().numpy().astype(np.int8))  # [in, out]
        if grid.granularity == "per_channel":  # output channels are the columns of the [in, out] codes
            s = self.const(f"{prefix}_scale", grid.scale.reshape(-1).float().numpy())
            z = self.const(f"{prefix}_zero_point", grid.zero_point.reshape(-1).numpy().astype(np.int8))
            return self.node(consumer, "DequantizeLinear", [codes, s, z], f"{prefix}_dequantized", axis=1)
        s = self.const(f"{prefix}_scale", np.array(float(grid.scale), np.float32))
        z = self.const(f"{prefix}_zero_point", np.array(int(grid.zero_point), np.int8))
        return self.node(consumer, "DequantizeLinear", [codes, s, z], f"{prefix}_dequantized")

    def per_token(self, x: str, consumer: Any, scheme: Scheme) -> tuple[str, str, str | None]:
        """ffnquant's per-token quantization (`primitives.fake_quantize_per_token`, `choose_qparams`) as ONNX ops:
        (codes, scale [b, s, 1], zero point [b, s, 1] or None when symmetric)."""
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

    def dynamic_matmul(self, grid: WeightGrid, scheme: Scheme, node: Any, q: torch.Tensor, prefix: str,
                       call: str = "") -> None:
        """Per-token codes x int8 weight codes in MatMulInteger (exact int32), then x token scale x channel scale;
        an asymmetric token zero point comes off as zp * (column sums of the codes), exact in int32. `call`: what
        sets this MatMul's nodes apart from another call's of the same weight (whose constants it shares)."""
        from onnx import TensorProto, helper

        codes, scale, zp = self.per_token(node.input[0], node, scheme)
        wq = self.const(f"{prefix}_quantized", q.T.contiguous().numpy().astype(np.int8))
        own = prefix + call
        acc = self.node(node, "MatMulInteger", [codes, wq], f"{own}_int32")
        if zp is not None:
            colsum = self.const(f"{prefix}_colsum", q.sum(1).numpy().astype(np.int32))
            zp_i = self.node(node, "Cast", [zp], f"{own}_zp_int32", to=TensorProto.INT32)
            acc = self.node(node, "Sub", [acc, self.node(node, "Mul", [zp_i, colsum], f"{own}_zp_cols")],
                            f"{own}_int32_centred")
        acc_f = self.node(node, "Cast", [acc], f"{own}_acc", to=TensorProto.FLOAT)
        per_token = self.node(node, "Mul", [acc_f, scale], f"{own}_token_scaled")
        w_scale = self.const(f"{prefix}_scale", grid.scale.reshape(-1).float().numpy())
        self.replace[id(node)] = [helper.make_node("Mul", [per_token, w_scale], list(node.output), name=f"{own}_Mul")]

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


def nbits_node(node, name: str, codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, group: int, k: int):
    """A MatMulNBits node and its initializers from unsigned int4 codes [N, K'] (0..15) and scale / zero points
    [N, K'/g]: integer zero points (0..15, packed two per byte) or HQQ's float ones; None is symmetric (8).

    K' = ceil(k / g) * g (the codes padded to whole blocks, `primitives.int4_group_rtn`); the node's
    K attribute is the real width k: MatMulNBits reads ceil(K / block_size) blocks per column and
    ignores the padded codes, as onnxruntime's own quantizer writes it.
    """
    from onnx import helper, numpy_helper

    n_out, k_padded = codes.shape
    blocks = k_padded // group
    if k_padded != blocks * group or blocks != -(-k // group):
        raise FFNQuantError(f"{name}: {k_padded} codes are not the {k} inputs padded to blocks of {group}")
    packed = P.pack_int4(codes.reshape(n_out, blocks, group)).numpy().astype(np.uint8)  # [N, blocks, g/2]
    inits = [
        numpy_helper.from_array(packed, f"{name}_Q4"),
        numpy_helper.from_array(scale.reshape(-1).numpy().astype(np.float32), f"{name}_scales"),
    ]
    inputs = [node.input[0], f"{name}_Q4", f"{name}_scales"]
    if zp is not None and zp.is_floating_point():  # HQQ: one float zero point per block, as its quantizer writes
        inits.append(numpy_helper.from_array(zp.reshape(-1).numpy().astype(np.float32), f"{name}_zero_points"))
        inputs.append(f"{name}_zero_points")
    elif zp is not None:  # zero points packed two per byte along the blocks of each column
        z = zp.reshape(n_out, blocks).to(torch.int32)
        if blocks % 2:
            z = torch.cat([z, torch.zeros(n_out, 1, dtype=torch.int32)], 1)
        inits.append(numpy_helper.from_array(P.pack_int4(z).numpy().astype(np.uint8).reshape(-1), f"{name}_zero_points"))
        inputs.append(f"{name}_zero_points")
    new = helper.make_node(
        "MatMulNBits", inputs, list(node.output), name=f"{node.name}_Q4", domain=MS_DOMAIN, K=k, N=n_out, bits=4, block_size=group
    )
    return new, inits


# MatMulBnb4's quant_type attribute (onnxruntime's contrib op): FP4 0, NF4 1
BNB4_TYPES = {"fp4": 0, "nf4": 1}


def bnb4_node(rw: MatmulRewriter, node: Any, name: str, ql: Any):
    """A MatMulBnb4 node from bitsandbytes' own packed nf4/fp4 codes and block absmax (`QuantizedLinear.codes`,
    `scale_float`): the same layout onnxruntime's bnb4 kernel reads (blocks over the row-major [out, in] weight)."""
    from onnx import helper

    n_out, k = ql.weight.shape
    packed = rw.const(f"{name}_Bnb4", ql.codes.numpy().astype(np.uint8))
    absmax = rw.const(f"{name}_absmax", ql.scale_float.numpy().astype(np.float32))
    return helper.make_node("MatMulBnb4", [node.input[0], packed, absmax], list(node.output), name=f"{node.name}_Bnb4",
                            domain=MS_DOMAIN, K=k, N=n_out, block_size=ql.scheme.group_size,
                            quant_type=BNB4_TYPES[str(ql.scheme.weight_dtype)])


def write_matmul(rw: MatmulRewriter, node: Any, init: Any, kind: str, *, scheme: Scheme, grid: WeightGrid, codes: Any,
                 input_mode: str | None, input_range: Any, prefix: str, in_features: int, rotation: Any = None,
                 call: str = "") -> None:
    """Rewrite one MatMul `node` (weight initializer `init`) as `kind` (`matmul_kind`) from the weight's signed
    `codes` on `grid`: its input rotated and quantized first where asked, then its weight. `call`: a later MatMul
    reading the same weight (a looped depth's), its weight's initializers shared, its own nodes named apart."""
    if rotation is not None:
        node.input[0] = rw.rotate(node.input[0], node, rotation)
    if input_mode == "static":
        node.input[0] = rw.static_qdq(node.input[0], node, input_range)
    if kind in ("float", "act-qdq"):
        return
    rw.removed.add(init.name)
    if kind == "dynamic-int8":
        rw.dynamic_matmul(grid, scheme, node, codes, prefix, call)
    elif kind == "nbits":  # MatMulNBits' unsigned layout: codes and zero points + 8
        g = grid.group_size
        blocks = codes.shape[1] // g
        new, inits = nbits_node(node, prefix, codes + 8, grid.scale.float().reshape(-1, blocks),
                                None if grid.symmetric else (grid.zero_point + 8).reshape(-1, blocks), g, in_features)
        rw.replace[id(node)] = [new]
        rw.add(inits)
    else:
        node.input[1] = rw.weight_dq(grid, node, codes, prefix)


def check_and_save(proto, path: str | os.PathLike) -> Path:
    """Check the graph fully and write it atomically."""
    import onnx

    onnx.checker.check_model(proto, full_check=True)
    with atomic_path(path) as tmp:
        onnx.save_model(proto, str(tmp))
    return Path(path)
