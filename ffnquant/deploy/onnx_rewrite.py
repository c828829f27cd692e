"""The FFN matmuls of an exported causal LM graph rewritten as its plan quantized them (see `deploy.onnx_model`).

Each FFN MatMul is found by name (the module the exporter records on each node), and its integer codes are
the method handler's own (`ModuleQuant.codes`, checked to give the weight back): nothing is quantized twice. What each matmul becomes is
`module_kind`; `quantize_graph` writes the rewritten graph.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import FFNQuantError

__all__ = ["module_kind", "quantize_graph", "MS_DOMAIN", "EXACT_WEIGHT_ONLY"]

MS_DOMAIN = "com.microsoft"
# onnxruntime's session option that keeps MatMulNBits / weight-only DQ in float (its default quantizes inputs)
EXACT_WEIGHT_ONLY = "session.qdq_matmulnbits_accuracy_level"


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
    """The integer codes of the planned weight `w` [out, in] (signed, int32; [out, K'] for groups): the method
    handler's own (`ModuleQuant.codes`), checked to give `w` back: the grid is what the model was quantized to, so
    any miss means a wrong graph. Nothing is rounded again."""
    grid, q = m.grid, m.codes
    if q is None:
        raise FFNQuantError(f"{m.module}: the planned module carries no integer codes; was it built by "
                            "build_planned_model?")
    scale, zp = grid.scale.float(), grid.zero_point.to(torch.int32)
    out_f, in_f = w.shape
    if grid.granularity == "per_group":
        g = grid.group_size
        scale, zp = scale.repeat_interleave(g, 1), zp.repeat_interleave(g, 1)
    else:
        scale, zp = scale.reshape(-1, 1) if scale.ndim else scale, zp.reshape(-1, 1) if zp.ndim else zp
    back = ((q - zp).float() * scale)[:, :in_f]
    err = float((back - w).abs().max())
    # exactly on the grid: (code - zp) * scale is the very product that made the weight
    if err > 1e-6 * float(scale.abs().max()):
        raise FFNQuantError(f"{m.module}: the model's weight is not on its {grid.bits}-bit grid (off by {err:.3g}); "
                            "was it built by build_planned_model?")
    return q


# --- the rewrite -------------------------------------------------------------------------------------

def _find_matmuls(proto: Any, planned: Any) -> dict[str, tuple[Any, Any]]:
    """{module: (MatMul node, its [in, out] weight initializer)}, found by name: torch's exporter records on every
    node the modules it came from (`pkg.torch.onnx.name_scopes`, full names under the export wrapper's own
    prefix, e.g. 'model.model.layers.3.mlp.down_proj' for 'model.layers.3.mlp.down_proj')."""
    import ast

    inits = {i.name: i for i in proto.graph.initializer}
    uses = Counter(x for n in proto.graph.node for x in n.input)
    wanted = {m.module for m in planned.modules}
    found: dict[str, tuple[Any, Any]] = {}
    for node in proto.graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2 or node.input[1] not in inits:
            continue
        meta = {p.key: p.value for p in node.metadata_props}
        try:
            scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
        except (ValueError, SyntaxError):
            continue
        if not scopes:
            continue
        # the innermost module scope (the last entry is the op itself): the Linear the MatMul computes
        hits = [m for m in wanted for scope in scopes[-2:] if scope == m or scope.endswith("." + m)]
        for module in hits:
            if module in found:
                raise FFNQuantError(f"{module}: two MatMul nodes of the graph come from it; cannot tell which one "
                                    "is this FFN's")
            init = inits[node.input[1]]
            if uses[init.name] != 1:
                raise FFNQuantError(f"{module}: its weight initializer feeds {uses[init.name]} nodes; a shared weight "
                                    "cannot be rewritten for one of them")
            found[module] = (node, init)
    missing = [m.module for m in planned.modules if m.module not in found]
    if missing:
        raise FFNQuantError(f"could not find the matmul(s) of {', '.join(missing[:3])}"
                            f"{' and more' if len(missing) > 3 else ''} in the graph (no MatMul with a weight "
                            "initializer names them in pkg.torch.onnx.name_scopes)")
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
            new, inits = _nbits_node(node, prefix, q + 8, m.grid.scale.float().reshape(-1, blocks),
                                     None if m.grid.symmetric else (m.grid.zero_point + 8).reshape(-1, blocks), g,
                                     w.shape[1])
            rw.replace[id(node)] = [new]
            rw.inits += inits
        else:
            node.input[1] = rw.weight_dq(m, node, q, prefix)
    rw.finish()
    if "nbits" in kinds.values() and not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    proto.ir_version = min(proto.ir_version, 10)
    props = {**{p.key: p.value for p in proto.metadata_props}, "ffnquant_graph": "quantized"}
    if "weight-dq" in kinds.values():
        # a default session turns DequantizeLinear -> MatMul into MatMulNBits at accuracy level 4, which quantizes
        # the activations on the fly: w8a16 computes what it says only with this entry (onnxquant.ort_session)
        props["ffnquant_session_config"] = f"{EXACT_WEIGHT_ONLY}=0"
    helper.set_model_props(proto, props)
    after = Counter(n.op_type for n in proto.graph.node)
    _check_and_save(proto, out_path)
    rows = [{"module": m.module, "layer": m.layer, "weight": m.weight, "recipe": m.recipe, "kind": kinds[m.module],
             "rotation": m.rotation is not None} for m in planned.modules]
    return {"path": str(out_path), "modules": rows, "kinds": dict(Counter(kinds.values())),
            "nodes": {"float": dict(before), "quantized": dict(after)},
            "n_nodes": {"float": sum(before.values()), "quantized": sum(after.values())},
            "bytes": {"source": os.path.getsize(float_path), "quantized": os.path.getsize(out_path)}}


