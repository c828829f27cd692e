"""Routed experts as onnxruntime's MoE and QMoE operators (com.microsoft): what each computes, their tensors from
ffnquant's integer codes, and the recipes QMoE stores.

Both take the token rows [T, d], a [T, E] input that selects each row's top-k experts, and every expert's first
matrix (fc1: gate and up rows interleaved, `swiglu_fusion=1`, the only form onnxruntime's CPU MoE computes) and
second (fc2: down), with optional biases. The activation of a gated expert is onnxruntime's swiglu:
G * sigmoid(alpha * G) * (L + beta), G = min(gate, limit), L = clamp(up, -limit, limit) (SiLU-GLU is alpha 1, beta
0, no limit; gpt-oss' clamped gate 1.702, 1, 7); an ungated one's relu, gelu, silu or identity.

Routing: MoE weighs the selected experts by the softmax of its [T, E] input (renormalised over the k or not);
QMoE takes the weights themselves (`router_weights`, the value at each selected expert) and uses its [T, E] input
for the selection alone. ffnquant hands both the model's own choice (`deploy.onnx_experts`), so any router
transformers computes is the graph's.

QMoE dequantizes (code - zero point) * scale, codes unsigned (ffnquant's signed codes + 2^(bits-1), packed two
per byte at 4 bits, first in the low nibble), per output row or per block of `block_size` inputs; onnxruntime's
CPU kernel computes 4-bit experts and 8-bit per-row experts on float activations, and block-wise 8-bit experts only
on int8 activations (its `accuracy_level` note), which is not a weight-only graph: refused.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import FFNQuantError, first_line
from ..numerics import primitives as P

__all__ = ["ExpertsOp", "UNGATED", "activation", "moe_unavailable", "qmoe_weight_refusal", "qmoe_tensors"]

MS_DOMAIN = "com.microsoft"

# the activations onnxruntime's MoE and QMoE compute on an ungated expert's fc1 output
UNGATED = ("relu", "gelu", "silu", "identity")


@dataclass(frozen=True)
class ExpertsOp:
    """What the experts of one module compute, as the operator's attributes: `activation` "swiglu" (gated, with
    `alpha`, `beta`, `limit`) or one of UNGATED; `k` experts per token."""

    activation: str
    k: int
    alpha: float = 1.0
    beta: float = 0.0
    limit: float | None = None

    def __post_init__(self) -> None:
        if self.activation != "swiglu" and self.activation not in UNGATED:
            raise FFNQuantError(f"experts activation {self.activation!r} is not one of onnxruntime's MoE activations "
                                f"(swiglu, {', '.join(UNGATED)})")
        if self.k < 1:
            raise FFNQuantError(f"experts per token must be >= 1, got {self.k}")

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    def attributes(self) -> dict[str, Any]:
        """The operator's attributes (MoE's and QMoE's alike; QMoE adds its bits and block)."""
        out: dict[str, Any] = {"k": self.k, "activation_type": self.activation, "normalize_routing_weights": 0}
        if self.gated:
            out.update(swiglu_fusion=1, activation_alpha=float(self.alpha), activation_beta=float(self.beta))
            if self.limit is not None:
                out["swiglu_limit"] = float(self.limit)
        return out


def activation(op: ExpertsOp, fc1_out: torch.Tensor) -> torch.Tensor:
    """What the operator computes from an expert's fc1 output [rows, 2f] (gate and up interleaved) or [rows, f]
    (ungated): onnxruntime's formula, in torch, for the check that it is the model's (`deploy.onnx_experts`)."""
    if op.gated:
        gate, up = fc1_out[..., 0::2], fc1_out[..., 1::2]
        if op.limit is not None:
            gate, up = gate.clamp(max=op.limit), up.clamp(-op.limit, op.limit)
        return gate * torch.sigmoid(op.alpha * gate) * (up + op.beta)
    if op.activation == "relu":
        return torch.relu(fc1_out)
    if op.activation == "gelu":
        return torch.nn.functional.gelu(fc1_out)
    if op.activation == "silu":
        return torch.nn.functional.silu(fc1_out)
    return fc1_out


def qmoe_weight_refusal(bits: int, granularity: str, group: int | None, d_model: int, d_ff: int) -> str | None:
    """Why QMoE cannot store experts on this weight grid (one line), None when it can: 4- or 8-bit integers, per
    output row or in blocks of a power of two >= 16 dividing both widths; block-wise 8-bit computes on int8
    activations in onnxruntime's CPU kernel."""
    if bits not in (4, 8):
        return f"QMoE stores 4- and 8-bit integer experts, not {bits}-bit"
    if granularity in ("per_channel",):
        return None
    if granularity != "per_group":
        return f"QMoE's scales are per output row or per block of inputs, not {granularity.replace('_', ' ')}"
    g = int(group or 0)
    if g < 16 or g & (g - 1):
        return f"QMoE's blocks are powers of two >= 16, the grid's groups are {g} wide"
    if d_model % g or d_ff % g:
        return f"QMoE's blocks of {g} inputs must divide both expert widths ({d_model} and {d_ff})"
    if bits == 8:
        return ("onnxruntime's CPU QMoE computes block-wise 8-bit experts on int8 activations (no float kernel), "
                "which is not the weight-only model measured")
    return None


def _unsigned(codes: torch.Tensor, bits: int) -> np.ndarray:
    """Signed codes as QMoE stores them: + 2^(bits-1), packed two per byte at 4 bits (first in the low nibble)."""
    u = (codes.to(torch.int32) + (1 << (bits - 1)))
    if int(u.min()) < 0 or int(u.max()) >= (1 << bits):
        raise FFNQuantError(f"codes outside the signed {bits}-bit range [{-(1 << (bits - 1))}, {(1 << (bits - 1)) - 1}]")
    if bits == 4:
        return P.pack_int4(u).numpy().astype(np.uint8)
    return u.to(torch.uint8).numpy()


def qmoe_tensors(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, bits: int,
                 group: int | None) -> dict[str, np.ndarray]:
    """One fc input of QMoE from every expert's signed codes [E, N, K] (K the input width, whole blocks), scales
    [E, N] (per row) or [E, N, K / group] and signed zero points of the scales' shape (None: symmetric, QMoE's
    default 2^(bits-1)): {"weights": uint8 [E, N, K * bits / 8], "scales": float32, "zero_points": uint8 or
    absent}."""
    n_exp, n_out, k = codes.shape
    if group:
        if k % group or scale.shape != (n_exp, n_out, k // group):
            raise FFNQuantError(f"QMoE block scales must be [{n_exp}, {n_out}, {k} / {group}], got {tuple(scale.shape)}")
    elif scale.shape != (n_exp, n_out):
        raise FFNQuantError(f"QMoE row scales must be [{n_exp}, {n_out}], got {tuple(scale.shape)}")
    out = {"weights": _unsigned(codes, bits), "scales": scale.to(torch.float32).numpy()}
    if zero_point is not None and bool(torch.any(zero_point != 0)):
        zp = zero_point.to(torch.int32)
        if bits == 4 and zp.shape[-1] % 2:  # packed per byte along the last axis: a padding nibble
            zp = torch.cat([zp, torch.zeros(*zp.shape[:-1], 1, dtype=torch.int32)], -1)
        packed = _unsigned(zp, bits)
        # per row: [E, ceil(N * bits / 8)]; per block: [E, N, ceil(blocks * bits / 8)]
        out["zero_points"] = packed if group else packed.reshape(n_exp, math.ceil(n_out * bits / 8))
    return out


@functools.cache
def moe_unavailable() -> str | None:
    """Why this onnxruntime cannot run the graph's experts (one line), None when it can: its CPU MoE (float32,
    interleaved swiglu) and QMoE (float32 activations, 4-bit blocks, the routing weights given) each run on a tiny
    case and give the experts' sum within float32 rounding (onnxruntime before 1.23 has neither on the CPU in
    float32, nor QMoE's router_weights)."""
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
    except ImportError as exc:
        return f"onnx or onnxruntime is not installed ({exc})"
    gen = torch.Generator().manual_seed(0)
    t, d, f, e, k = 3, 16, 16, 2, 1
    x = torch.randn(t, d, generator=gen)
    fc1, fc2 = torch.randn(e, 2 * f, d, generator=gen) / 4, torch.randn(e, d, f, generator=gen) / 4
    chosen = torch.zeros(t, e)
    chosen[torch.arange(t), torch.tensor([0, 1, 0])] = 1.0
    weights = chosen * 0.75
    op = ExpertsOp("swiglu", k)
    # QMoE's codes: the weights rounded to 4 bits per block of 16, so both operators compute one model
    scale = fc1.abs().amax(-1, keepdim=True) / 7
    q1 = torch.round(fc1 / scale).clamp(-8, 7)
    scale2 = fc2.abs().amax(-1, keepdim=True) / 7
    q2 = torch.round(fc2 / scale2).clamp(-8, 7)
    w1, w2 = q1 * scale, q2 * scale2
    want = torch.zeros(t, d)
    for row in range(t):
        ex = int(chosen[row].argmax())
        want[row] = 0.75 * (activation(op, x[row] @ w1[ex].T) @ w2[ex].T)
    t1, t2 = qmoe_tensors(q1.int(), scale, None, 4, 16), qmoe_tensors(q2.int(), scale2, None, 4, 16)

    def run(node, inits: dict, feeds: dict) -> np.ndarray:
        graph = helper.make_graph(
            [node], "probe", [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(v.shape)) for n, v in feeds.items()],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [t, d])],
            initializer=[numpy_helper.from_array(v, n) for n, v in inits.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS_DOMAIN, 1)])
        model.ir_version = 10
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return session.run(["y"], feeds)[0]

    attrs = op.attributes()
    feeds = {"x": x.numpy(), "chosen": chosen.numpy(), "w": weights.numpy()}
    try:
        logits = torch.where(chosen > 0, torch.zeros(()), torch.tensor(-math.inf))
        moe = run(helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain=MS_DOMAIN, **attrs),
                  {"fc1": w1.numpy(), "fc2": w2.numpy()}, {"x": feeds["x"], "logits": logits.numpy()}) * 0.75
        qmoe = run(helper.make_node("QMoE", ["x", "chosen", "q1", "s1", "", "q2", "s2", "", "", "", "", "", "", "", "w"],
                                    ["y"], domain=MS_DOMAIN, expert_weight_bits=4, block_size=16, **attrs),
                   {"q1": t1["weights"], "s1": t1["scales"], "q2": t2["weights"], "s2": t2["scales"]}, feeds)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own refusal of the operator, said in one line
        return f"onnxruntime {ort.__version__} does not run MoE/QMoE on the CPU in float32: {first_line(exc)}"
    for name, got in (("MoE", moe), ("QMoE", qmoe)):
        err = float(np.abs(got - want.numpy()).max())
        if not err <= 1e-4 * float(want.abs().max()):
            return f"onnxruntime {ort.__version__}'s CPU {name} does not compute the experts' sum (off by {err:.3g})"
    return None
