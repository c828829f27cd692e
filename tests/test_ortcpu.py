"""ortcpu: the int8 kernel probe agrees with an exact integer computation, the session entries follow from it,
and an ONNX graph's int8 activation dtypes are read from its QuantizeLinear zero points and MatMulInteger casts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ffnquant.onnx.onnxquant import ort_session
from ffnquant.onnx.ortcpu import (
    INT8_ALLOWED, Int8Kernels, graph_int8_activations, int8_kernels, qdq_matmul, saturating, session_entries,
)


def _qdq_matmul(path, activation: str, k: int = 64, n: int = 8, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """ortcpu's probe pattern with random full-range codes, saved; returns (x codes, W codes)."""
    rng = np.random.default_rng(seed)
    lo, hi, dtype = (0, 256, np.uint8) if activation == "uint8" else (-128, 128, np.int8)
    xq = rng.integers(lo, hi, (16, k)).astype(dtype)
    w = rng.integers(-127, 128, (k, n)).astype(np.int8)
    onnx.save(qdq_matmul(activation, w), str(path))
    return xq, w


@pytest.mark.parametrize("activation", ["uint8", "int8"], ids=str)
def test_the_probe_predicts_what_a_random_int8_matmul_computes(activation, tmp_path):
    """Random full-range codes: exact int32 sums where the probe says exact, and the as-written session always."""
    path = tmp_path / "m.onnx"
    xq, w = _qdq_matmul(path, activation)
    exact = xq.astype(np.int64) @ w.astype(np.int64)
    x = xq.astype(np.float32)
    got = ort_session(path).run(None, {"input": x})[0]
    assert np.array_equal(got, exact) == int8_kernels().exact(activation)
    # with graph optimizations off, DequantizeLinear then a float MatMul: exact (|sums| < 2^24 here)
    assert np.array_equal(ort_session(path, as_written=True).run(None, {"input": x})[0], exact)


@pytest.mark.parametrize("kernels, entries", [
    (Int8Kernels(True, True, True, ("avx512_vnni",)), {}),
    (Int8Kernels(False, False, True, ("avx2",)), {INT8_ALLOWED: "1"}),
    (Int8Kernels(False, False, False, ()), {}),  # the entry would not help: leave the default
], ids=["vnni", "avx2", "nothing-helps"])
def test_session_entries_follow_from_the_probe(kernels, entries):
    assert session_entries(kernels) == entries
    assert kernels.s8_exact == (kernels.s8_exact_default or kernels.s8_exact_int8_allowed)
    text = kernels.describe()
    assert ("saturate" in text) == (not kernels.u8_exact or not kernels.s8_exact_default)
    assert kernels.to_dict()["session_entries"] == entries


def test_graph_activation_dtypes_are_read_from_the_graph(tmp_path):
    _qdq_matmul(tmp_path / "u8.onnx", "uint8")
    _qdq_matmul(tmp_path / "s8.onnx", "int8")
    assert graph_int8_activations(onnx.load(str(tmp_path / "u8.onnx"))) == {"uint8"}
    assert graph_int8_activations(onnx.load(str(tmp_path / "s8.onnx"))) == {"int8"}
    # saturating(): the graph's dtypes this CPU does not compute exactly, from a path or a loaded graph
    assert saturating(tmp_path / "u8.onnx") == ([] if int8_kernels().u8_exact else ["uint8"])
    assert saturating(onnx.load(str(tmp_path / "s8.onnx"))) == ([] if int8_kernels().s8_exact else ["int8"])
    # per-token inputs: codes cast to int8 and handed to MatMulInteger
    nodes = [helper.make_node("Cast", ["x"], ["c"], to=TensorProto.INT8),
             helper.make_node("MatMulInteger", ["c", "w"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, [2, 3])],
                              [numpy_helper.from_array(np.ones((4, 3), np.int8), "w")])
    assert graph_int8_activations(helper.make_model(graph)) == {"int8"}
    float_graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    assert graph_int8_activations(helper.make_model(float_graph)) == set()


def test_the_probe_is_measured_once_per_process():
    assert int8_kernels() is int8_kernels()
    assert set(int8_kernels().flags) <= {"avx2", "avx512bw", "avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_int8",
                                         "asimddp", "i8mm"}
