"""What onnxruntime's int8 CPU kernels compute on THIS machine, measured rather than assumed.

onnxruntime fuses an int8 QDQ MatMul (activation Q -> DQ, weight DQ, MatMul) into an integer GEMM.
On x86 its u8 x s8 GEMM multiplies pairs of bytes into a 16-bit sum (VPMADDUBSW) unless the CPU has
VNNI (VPDPBUSD sums four products straight into 32 bits). Two products of 255 x 127 overflow 16 bits
and the sum saturates at 32767: on AVX2/AVX-512 CPUs without VNNI a u8-activation artifact computes
something else than its graph says. int8 activations are converted to u8 (+128) on x86 by default,
so they saturate the same way; with `session.qdqisint8allowed=1` they run an s8 x s8 kernel instead,
whose products (at most 128 x 128) cannot overflow a 16-bit pair sum.

`int8_kernels()` runs that pattern once on a tiny graph whose exact answer is known, in every session
setting that matters, and `session_entries()` is what ffnquant's sessions set from it: the int8-allowed
entry where it turns a saturating int8 path into an exact one, nothing elsewhere. u8 activations on a
saturating CPU have no such switch: their artifacts are measured as they run, and next to it their
graph's exact value (`exact_session_options`: graph optimizations off, DequantizeLinear then a float MatMul).
`saturating(graph)` names the activation dtypes of a graph that this CPU's kernels do not compute exactly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

__all__ = ["Int8Kernels", "int8_kernels", "session_entries", "exact_session_options", "cpu_flags", "qdq_matmul",
           "graph_int8_activations", "saturating"]

# The session entry that lets onnxruntime's QDQ fusion keep int8 activations on x86 (s8 x s8 kernel).
INT8_ALLOWED = "session.qdqisint8allowed"
# The CPU flags that decide the int8 dot product's width (x86: VNNI, AMX; arm64: the dot-product extension).
_FLAGS = ("avx2", "avx512bw", "avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_int8", "asimddp", "i8mm")


def cpu_flags() -> tuple[str, ...]:
    """The int8-relevant flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    present = set(line.split(":", 1)[1].split())
                    return tuple(f for f in _FLAGS if f in present)
    except OSError:
        pass
    return ()


@dataclasses.dataclass(frozen=True)
class Int8Kernels:
    """Whether onnxruntime's CPU int8 MatMul is exact here, per activation dtype and session setting."""

    u8_exact: bool  # u8 activations x s8 weights, default session
    s8_exact_default: bool  # s8 activations, default session (converted to u8 on x86)
    s8_exact_int8_allowed: bool  # s8 activations with session.qdqisint8allowed=1
    flags: tuple[str, ...]

    @property
    def s8_exact(self) -> bool:
        """s8 activations are exact in ffnquant's sessions (which set the entry where it helps)."""
        return self.s8_exact_default or self.s8_exact_int8_allowed

    def exact(self, activation: str) -> bool:
        """Whether an artifact with `activation` ('uint8' | 'int8') activations runs exactly in ffnquant's sessions."""
        return self.u8_exact if activation == "uint8" else self.s8_exact

    def describe(self) -> str:
        """One line: what the kernels do here and why."""
        isa = ", ".join(self.flags) or "flags unknown"
        if self.u8_exact and self.s8_exact_default:
            return f"onnxruntime's int8 CPU kernels are exact on this CPU ({isa})"
        parts = []
        if not self.u8_exact:
            parts.append("u8-activation MatMuls saturate (16-bit pair sums, no VNNI)")
        if not self.s8_exact_default:
            parts.append("int8-activation MatMuls saturate in a default session (converted to u8)"
                         + (f"; exact with {INT8_ALLOWED}=1, which ffnquant sets" if self.s8_exact_int8_allowed else ""))
        return f"on this CPU ({isa}) " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"u8_exact": self.u8_exact, "s8_exact_default": self.s8_exact_default,
                "s8_exact_int8_allowed": self.s8_exact_int8_allowed, "flags": list(self.flags),
                "session_entries": session_entries(self), "summary": self.describe()}


def qdq_matmul(activation: str, weight_codes: np.ndarray):
    """x -> Q -> DQ, W -> DQ, MatMul with unit scales and zero points 0: the pattern of ffnquant's QDQ artifacts,
    whose exact answer is the integer product of x's codes ('uint8' | 'int8') and `weight_codes` (int8 [k, n])."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = weight_codes.shape
    zp = np.array(0, dtype=np.uint8 if activation == "uint8" else np.int8)  # its dtype sets the activation's
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "s"), numpy_helper.from_array(zp, "zp"),
             numpy_helper.from_array(weight_codes.astype(np.int8), "w"),
             numpy_helper.from_array(np.ones(n, np.float32), "ws"), numpy_helper.from_array(np.zeros(n, np.int8), "wzp")]
    nodes = [helper.make_node("QuantizeLinear", ["input", "s", "zp"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "s", "zp"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wzp"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["output"])]
    graph = helper.make_graph(nodes, "int8_probe", [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, [None, n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def _exact_here(activation: str, entries: dict[str, str]) -> bool:
    """Codes that make two adjacent products 255 x 127 (or 127 x 127 shifted to u8): a 16-bit pair sum saturates."""
    import onnxruntime as ort

    k = 64
    model = qdq_matmul(activation, np.full((k, 16), 127, dtype=np.int8))
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    for key, value in entries.items():
        opts.add_session_config_entry(key, value)
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    top = 255.0 if activation == "uint8" else 127.0
    y = session.run(None, {"input": np.full((4, k), top, dtype=np.float32)})[0]
    return bool(np.array_equal(y, np.full_like(y, top * 127.0 * k)))


@functools.lru_cache(maxsize=1)
def int8_kernels() -> Int8Kernels:
    """Measure once per process whether onnxruntime's CPU int8 MatMuls are exact here (a 4x64x16 probe, milliseconds)."""
    return Int8Kernels(
        u8_exact=_exact_here("uint8", {}),
        s8_exact_default=_exact_here("int8", {}),
        s8_exact_int8_allowed=_exact_here("int8", {INT8_ALLOWED: "1"}),
        flags=cpu_flags(),
    )


def session_entries(kernels: Int8Kernels | None = None) -> dict[str, str]:
    """The session config entries ffnquant's CPU sessions set for exact int8 arithmetic on this machine."""
    k = kernels or int8_kernels()
    return {INT8_ALLOWED: "1"} if not k.s8_exact_default and k.s8_exact_int8_allowed else {}


def exact_session_options():
    """SessionOptions that run a QDQ graph as written (DequantizeLinear then float MatMul): its exact value."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return opts


def graph_int8_activations(proto) -> set[str]:
    """'uint8' / 'int8' for each activation dtype an ONNX graph multiplies as int8 codes: the zero points of its
    QuantizeLinear nodes and the codes its Casts hand to MatMulInteger (per-token inputs)."""
    from onnx import TensorProto

    names = {TensorProto.UINT8: "uint8", TensorProto.INT8: "int8"}
    inits = {i.name: i.data_type for i in proto.graph.initializer}
    consts = {n.output[0]: n.attribute[0].t.data_type for n in proto.graph.node
              if n.op_type == "Constant" and n.attribute and n.attribute[0].HasField("t")}
    integer_inputs = {i for n in proto.graph.node if n.op_type == "MatMulInteger" for i in n.input[:1]}
    found = set()
    for n in proto.graph.node:
        if n.op_type == "QuantizeLinear" and len(n.input) > 2:
            dtype = inits.get(n.input[2], consts.get(n.input[2]))
            if dtype in names:
                found.add(names[dtype])
        elif n.op_type == "Cast" and n.output[0] in integer_inputs:
            to = next((a.i for a in n.attribute if a.name == "to"), None)
            if to in names:
                found.add(names[to])
    return found


def saturating(graph) -> list[str]:
    """The int8 activation dtypes of `graph` (an ONNX path or ModelProto) that ffnquant's CPU sessions do not compute
    exactly on this machine (`int8_kernels`); empty where every int8 MatMul of the graph is exact here."""
    import onnx

    proto = graph if isinstance(graph, onnx.ModelProto) else onnx.load(str(graph), load_external_data=False)
    return sorted(a for a in graph_int8_activations(proto) if not int8_kernels().exact(a))
