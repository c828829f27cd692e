"""onnx.moe: QMoE's tensors from ffnquant's signed codes, the grids it stores, onnxruntime's activations, and the
CPU kernels' check; the trap of onnxruntime's CPU MoE whose output takes its input's buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.numerics.primitives import unpack_int4
from ffnquant.onnx.moe import ExpertsOp, activation, moe_unavailable, qmoe_tensors, qmoe_weight_refusal


def _codes(bits: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), shape, generator=gen, dtype=torch.int32)


@pytest.mark.parametrize("bits,group", [(4, None), (4, 16), (8, None)], ids=["4bit-rows", "4bit-blocks", "8bit-rows"])
def test_codes_are_stored_unsigned_and_packed_low_nibble_first(bits, group):
    codes = _codes(bits, (3, 6, 32))
    scale = torch.rand(3, 6, 32 // group) if group else torch.rand(3, 6)
    out = qmoe_tensors(codes, scale, None, bits, group)
    weights = torch.from_numpy(out["weights"])
    assert out["weights"].dtype == np.uint8 and weights.shape == (3, 6, 32 * bits // 8)
    back = unpack_int4(weights, signed=False) if bits == 4 else weights.to(torch.int32)
    # QMoE's default zero point is 2^(bits-1): the symmetric grid needs none stored
    assert torch.equal(back - (1 << (bits - 1)), codes) and "zero_points" not in out
    assert np.array_equal(out["scales"], scale.numpy())


def test_asymmetric_zero_points_are_packed_along_each_rows_blocks():
    codes, zp = _codes(4, (2, 4, 48)), _codes(4, (2, 4, 3), seed=1)  # three blocks of 16: a padding nibble
    out = qmoe_tensors(codes, torch.rand(2, 4, 3), zp, 4, 16)
    packed = torch.from_numpy(out["zero_points"])
    assert packed.shape == (2, 4, 2)
    assert torch.equal(unpack_int4(packed, signed=False)[..., :3] - 8, zp)
    rows = qmoe_tensors(_codes(4, (2, 5, 32)), torch.rand(2, 5), _codes(4, (2, 5), seed=2), 4, None)
    assert rows["zero_points"].shape == (2, 3)  # ceil(5 rows * 4 bits / 8)


def test_codes_outside_the_signed_range_are_refused():
    with pytest.raises(FFNQuantError, match="outside the signed 4-bit range"):
        qmoe_tensors(torch.full((1, 2, 16), 9, dtype=torch.int32), torch.ones(1, 2), None, 4, None)


@pytest.mark.parametrize("bits,granularity,group,why", [
    (4, "per_channel", None, None),
    (4, "per_group", 32, None),
    (8, "per_channel", None, None),
    (2, "per_channel", None, "4- and 8-bit"),
    (8, "per_tensor", None, "per output row or per block"),
    (4, "per_group", 24, "powers of two"),
    (4, "per_group", 128, "must divide both expert widths"),
    (8, "per_group", 32, "int8 activations"),
], ids=["4bit-rows", "4bit-g32", "8bit-rows", "2bit", "per-tensor", "g24", "g128-too-wide", "8bit-blocks"])
def test_the_grids_qmoe_stores(bits, granularity, group, why):
    got = qmoe_weight_refusal(bits, granularity, group, 64, 96)
    assert (got is None) if why is None else (why in got)


def test_onnxruntimes_activations_in_torch():
    x = torch.linspace(-12, 12, 48).reshape(2, 24)
    gate, up = x[:, 0::2], x[:, 1::2]
    silu_glu = activation(ExpertsOp("swiglu", 2), x)
    assert torch.allclose(silu_glu, torch.nn.functional.silu(gate) * up)
    clamped = activation(ExpertsOp("swiglu", 2, 1.702, 1.0, 7.0), x)
    g, u = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    assert torch.allclose(clamped, g * torch.sigmoid(1.702 * g) * (u + 1.0))
    assert torch.equal(activation(ExpertsOp("relu", 1), x), torch.relu(x))
    assert ExpertsOp("swiglu", 2, limit=7.0).attributes() == {
        "k": 2, "activation_type": "swiglu", "normalize_routing_weights": 0, "swiglu_fusion": 1,
        "activation_alpha": 1.0, "activation_beta": 0.0, "swiglu_limit": 7.0}
    with pytest.raises(FFNQuantError, match="not one of onnxruntime's MoE activations"):
        ExpertsOp("tanh", 1)


def test_this_onnxruntime_runs_both_operators_on_the_cpu():
    pytest.importorskip("onnxruntime")
    assert moe_unavailable() is None


def test_onnxruntimes_cpu_moe_is_right_once_its_input_is_read_after_it():
    """onnxruntime 1.31's CPU MoE, in a graph where its input has no later reader (its output may take the input's
    buffer), does not return the experts' sum; with a Concat reading the input after it (what
    `deploy.onnx_experts.GraphExperts` writes) it does."""
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper

    gen = torch.Generator().manual_seed(0)
    t, d, f, e = 5, 32, 64, 4
    x = torch.randn(1, t, d, generator=gen)
    fc1, fc2 = torch.randn(e, 2 * f, d, generator=gen) * 0.2, torch.randn(e, d, f, generator=gen) * 0.2
    router = torch.randn(d, e, generator=gen)
    rows = x[0] * 1.5
    probs = torch.softmax(rows @ router, -1)
    top, index = probs.topk(2, -1)
    want = x[0].clone()
    op = ExpertsOp("swiglu", 2)
    for r in range(t):
        for w, ex in zip(top[r], index[r]):
            want[r] += w * (activation(op, rows[r] @ fc1[ex].T) @ fc2[ex].T)

    def graph(kept: bool) -> np.ndarray:
        nodes = [helper.make_node("Mul", ["X", "c"], ["normed"]), helper.make_node("Reshape", ["normed", "s2"], ["y"]),
                 helper.make_node("MatMul", ["y", "router"], ["logits"]),
                 helper.make_node("MoE", ["y", "logits", "fc1", "", "fc2"], ["moe"], domain="com.microsoft",
                                  **op.attributes())]
        if kept:
            nodes += [helper.make_node("Concat", ["moe", "y"], ["both"], axis=-1),
                      helper.make_node("Slice", ["both", "zero", "width", "last"], ["moe_kept"])]
        nodes += [helper.make_node("Reshape", ["moe_kept" if kept else "moe", "s3"], ["moe3"]),
                  helper.make_node("Add", ["X", "moe3"], ["out"])]
        consts = {"c": np.array([1.5], np.float32), "s2": np.array([t, d]), "s3": np.array([1, t, d]),
                  "router": router.numpy(), "fc1": fc1.numpy(), "fc2": fc2.numpy(), "zero": np.array([0]),
                  "width": np.array([d]), "last": np.array([-1])}
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, t, d])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, t, d])],
                              initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()])
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(["out"], {"X": x.numpy()})[0][0]

    # MoE's weights: the softmax of the logits over all experts at the top 2 (not renormalised), as `probs`
    err = np.abs(graph(kept=True) - want.numpy()).max()
    assert err <= 1e-4 * np.abs(want.numpy()).max(), err
    unkept = np.abs(graph(kept=False) - want.numpy()).max()
    if unkept <= 1e-4 * np.abs(want.numpy()).max():  # said, not failed: a later onnxruntime may have fixed it
        print(f"onnxruntime {ort.__version__}'s CPU MoE is right without the kept input too")
