"""Primitives: quantization error bounds (hypothesis), int4 packing, hand-derived cases, format round trips."""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ffnquant.numerics import primitives as P
from ffnquant.errors import FFNQuantError

GRIDS = [
    pytest.param(8, False, False, id="uint8-asym"),
    pytest.param(8, True, True, id="int8-sym"),
    pytest.param(8, True, False, id="int8-asym"),
    pytest.param(4, True, True, id="int4-sym"),
    pytest.param(4, False, False, id="uint4-asym"),
]

ranges = st.tuples(
    st.floats(-1e4, 1e4, allow_nan=False, width=32), st.floats(-1e4, 1e4, allow_nan=False, width=32)
).map(sorted)


@pytest.mark.parametrize("bits, signed, symmetric", GRIDS)
@settings(max_examples=30, deadline=None)
@given(rng=ranges, seed=st.integers(0, 2**31 - 1))
@example(rng=[0.0, 1.3357176961944156e-41], seed=0)  # a subnormal span: its scale would be subnormal too
def test_error_within_half_a_step_inside_the_range(bits, signed, symmetric, rng, seed):
    lo, hi = rng
    qmin, qmax = P.int_range(bits, signed)
    scale, zp = P.choose_qparams(lo, hi, qmin, qmax, symmetric)
    assert float(scale) > 0
    assert qmin <= int(zp) <= qmax
    lo0, hi0 = min(lo, 0.0), max(hi, 0.0)
    x = torch.empty(256).uniform_(lo0, hi0, generator=torch.Generator().manual_seed(seed)) if hi0 > lo0 else torch.zeros(256)
    x = torch.cat([x, torch.tensor([lo0, hi0, 0.0])])
    err = (x - P.fake_quantize(x, scale, zp, qmin, qmax)).abs()
    # half a step, plus float32 rounding of x / scale at the range's magnitude
    tol = float(scale) / 2 * (1 + 1e-5) + 1e-6 * max(abs(lo0), abs(hi0))
    assert float(err.max()) <= tol
    assert float(P.fake_quantize(torch.zeros(1), scale, zp, qmin, qmax)) == 0.0  # zero is exact


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), signed=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_int4_pack_unpack_round_trip(n, signed, seed):
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if signed else (0, 16)
    q = torch.randint(lo, hi, (3, 2 * n), generator=g, dtype=torch.int32)
    packed = P.pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, n)
    assert torch.equal(P.unpack_int4(packed, signed), q)


def test_pack_int4_low_nibble_first():
    assert P.pack_int4(torch.tensor([1, 2, 15, 0])).tolist() == [0x21, 0x0F]
    with pytest.raises(FFNQuantError, match="even"):
        P.pack_int4(torch.tensor([1, 2, 3]))


def test_hand_derived_uint8_case():
    # [-1, 1.55] on 0..255: scale 2.55 / 255 = 0.01, zero point 1 / 0.01 = 100
    scale, zp = P.choose_qparams(-1.0, 1.55, 0, 255, False)
    assert math.isclose(float(scale), 0.01, rel_tol=1e-6) and int(zp) == 100
    q = P.quantize(torch.tensor([-1.0, 0.0, 0.014, 0.016, 1.55, 9.0]), scale, zp, 0, 255)
    assert q.tolist() == [0, 100, 101, 102, 255, 255]
    # symmetric int8: absmax / 127, zero point 0
    scale, zp = P.choose_qparams(-0.5, 2.54, -128, 127, True)
    assert math.isclose(float(scale), 0.02, rel_tol=1e-6) and int(zp) == 0


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), symmetric=st.booleans(), group=st.sampled_from([8, 16, 32]))
def test_int4_group_rtn_codes_and_error(seed, symmetric, group):
    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(seed))
    q, scale, zp = P.int4_group_rtn(w, group, symmetric)
    assert q.min() >= 0 and q.max() <= 15
    assert torch.all(zp >= 0) and torch.all(zp <= 15)
    deq = P.int4_group_dequantize(q, scale, zp)
    s = scale.expand(-1, -1, group).reshape(w.shape)
    z = zp.expand(-1, -1, group).reshape(w.shape).float()
    t = w / s + z  # position on the code axis
    inside = (t >= -0.5) & (t <= 15.5)
    err = (w - deq).abs()
    assert torch.all(err[inside] <= s.abs()[inside] / 2 * (1 + 1e-5) + 1e-7)
    # symmetric groups span [-8 s, 7 s]: the side opposite the extreme may clip by up to one step
    assert torch.all(err <= s.abs() * (1 + 1e-5) + 1e-7)


def test_int4_symmetric_maps_signed_extreme_to_minus_eight():
    w = torch.tensor([[0.1, -0.8, 0.4, 0.7]])
    q, scale, zp = P.int4_group_rtn(w, 4, True)
    assert math.isclose(float(scale), 0.1, rel_tol=1e-6) and int(zp) == 8 and q[0, 1] == 0


def _sqnr(ref, got):
    return 20 * math.log10(float(ref.norm() / (ref - got).norm()))


@pytest.mark.parametrize(
    "name, fn, floor",
    [
        # 8-bit symmetric per channel over +-absmax (~3.4 sigma at 256 Gaussians): 10 log10(12 * 127^2 / 3.4^2) = 42 dB
        pytest.param("int8-per-channel", lambda w: P.fake_quantize_weight(w, "per_channel", 8, True), 38.0, id="int8-pc"),
        # int4 groups of 128 (absmax ~2.6 sigma): 10 log10(12 * 7.5^2 / 2.6^2) = 20 dB
        pytest.param("int4-g128", lambda w: P.int4_group_dequantize(*P.int4_group_rtn(w, 128, True)), 18.0, id="int4-g128"),
        pytest.param("int4-g32", lambda w: P.int4_group_dequantize(*P.int4_group_rtn(w, 32, True)), 20.0, id="int4-g32"),
        # NF4's 16 levels at normal quantiles: about 20.5 dB on Gaussian weights
        pytest.param("nf4", lambda w: P.bnb_4bit_fake(w, "nf4", 64), 19.0, id="nf4"),
        pytest.param("fp8", lambda w: P.fp8_weight_fake(w, "per_channel"), 28.0, id="fp8-e4m3"),
        pytest.param("hqq-g64", lambda w: P.hqq_int4(w, 64), 18.0, id="hqq-g64"),
    ],
)
def test_weight_sqnr_floors_on_gaussian_weights(name, fn, floor):
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0))
    assert _sqnr(w, fn(w)) >= floor


def test_fp8_relative_error_is_half_an_ulp():
    x = torch.linspace(-440, 440, 1001)
    y = P.fp8_e4m3_fake(x, 1.0)
    big = x.abs() >= 2**-6
    # 3 mantissa bits: relative rounding error <= 2^-4
    assert torch.all((x - y)[big].abs() <= x[big].abs() * 2**-4 + 1e-6)
    assert float(P.fp8_e4m3_fake(torch.tensor([1e6]), 1.0)) == 448.0  # saturates


def test_per_token_dynamic_bounds_each_row():
    x = torch.randn(5, 64) * torch.tensor([0.01, 1, 10, 100, 1000])[:, None]
    y = P.fake_quantize_per_token(x, 8, False, False)
    step = (x.amax(1) - x.amin(1).clamp(max=0)).clamp_min(0) / 255
    assert torch.all((x - y).abs().amax(1) <= step / 2 * (1 + 1e-5) + 1e-6)


def test_gptq_with_identity_hessian_is_rtn():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    rtn = P.int4_group_dequantize(*P.int4_group_rtn(w, 32, True))
    gptq = P.gptq_int4(w, torch.eye(64), 32, True)
    assert torch.allclose(gptq, rtn, atol=1e-6)


def test_gptq_beats_rtn_on_correlated_inputs():
    g = torch.Generator().manual_seed(2)
    mix = torch.randn(64, 64, generator=g)
    x = torch.randn(2048, 64, generator=g) @ mix  # correlated features: where GPTQ's error feedback pays
    w = torch.randn(32, 64, generator=g)
    h = x.double().T @ x.double()
    rtn = P.int4_group_dequantize(*P.int4_group_rtn(w, 32, True))
    gptq = P.gptq_int4(w, h, 32, True)
    ref = x @ w.T
    assert _sqnr(ref, x @ gptq.T) > _sqnr(ref, x @ rtn.T) + 1.0


# --- groups that do not divide the input width ------------------------------------------


def _old_int4_group_rtn(w, g, symmetric):
    """int4_group_rtn as it was before padding (divisible K only), kept to pin the old numbers."""
    out_f, in_f = w.shape
    wg = w.detach().float().reshape(out_f, in_f // g, g)
    if symmetric:
        extreme = torch.gather(wg, 2, wg.abs().argmax(dim=2, keepdim=True))
        scale = extreme / -8.0
        scale = torch.where(scale != 0, scale, torch.ones_like(scale))
        zp = torch.full_like(scale, 8, dtype=torch.int32)
    else:
        scale, zp = P.choose_qparams(wg.amin(dim=2, keepdim=True), wg.amax(dim=2, keepdim=True), 0, 15, False)
    q = torch.clamp(torch.round(wg / scale) + zp, 0, 15).to(torch.int32)
    return q.reshape(w.shape), scale, zp


def _old_gptq_int4_codes(w, hessian, g, symmetric, percdamp=0.01, block=128):
    """gptq_int4_codes as it was before padding (divisible K only)."""
    W = w.detach().float().clone()
    out_f, in_f = W.shape
    H = hessian.detach().double().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += percdamp * torch.mean(torch.diag(H)) * torch.eye(in_f, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True).float()
    codes = torch.zeros(W.shape, dtype=torch.int32)
    scales, zps = torch.zeros(out_f, in_f // g, 1), torch.zeros(out_f, in_f // g, 1, dtype=torch.int32)
    for i1 in range(0, in_f, block):
        i2 = min(i1 + block, in_f)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if col % g == 0:
                _, scale, zp = _old_int4_group_rtn(torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :g], g, symmetric)
                scale, zp = scale[:, 0], zp[:, 0]
                scales[:, col // g], zps[:, col // g] = scale, zp
            wcol = W1[:, i : i + 1]
            q = torch.clamp(torch.round(wcol / scale) + zp, 0, 15)
            codes[:, col : col + 1] = q.to(torch.int32)
            err = (wcol - (q - zp) * scale) / Hinv1[i, i]
            W1[:, i:] -= err @ Hinv1[i : i + 1, i:]
            Err[:, i : i + 1] = err
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    return codes, scales, zps


def _weights(out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, in_f, generator=g) * 0.05


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("in_f, group", [(64, 32), (128, 64), (256, 128), (96, 32)])
def test_divisible_groups_give_exactly_the_old_numbers(in_f, group, symmetric):
    """Padding changes nothing when g divides K: codes, scales, zero points, GPTQ, the int8 group grid
    and bitsandbytes' blocks are bit-identical to the code before padding (the committed reports stand)."""
    w = _weights(48, in_f)
    new, old = P.int4_group_rtn(w, group, symmetric), _old_int4_group_rtn(w, group, symmetric)
    for a, b in zip(new, old):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert torch.equal(P.int4_group_dequantize(*new, in_f), P.int4_group_dequantize(*old))
    x = torch.randn(200, in_f, generator=torch.Generator().manual_seed(2))
    H = x.T @ x
    for a, b in zip(P.gptq_int4_codes(w, H, group, symmetric), _old_gptq_int4_codes(w, H, group, symmetric)):
        assert torch.equal(a, b)
    qmin, qmax = P.int_range(8, signed=symmetric)
    scale, zp = P.choose_qparams(w.reshape(48, -1, group).amin(2, keepdim=True), w.reshape(48, -1, group).amax(2, keepdim=True),
                                 qmin, qmax, symmetric)
    old_fq = P.fake_quantize(w.reshape(48, -1, group), scale, zp, qmin, qmax).reshape(w.shape)
    assert torch.equal(P.fake_quantize_weight(w, "per_group", 8, symmetric, group), old_fq)


def test_bnb_4bit_divisible_is_bitsandbytes_own_2d_call():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    w = _weights(160, 64)
    packed, state = bnbf.quantize_4bit(w.contiguous(), blocksize=64, quant_type="nf4")
    assert torch.equal(P.bnb_4bit_fake(w, "nf4", 64), bnbf.dequantize_4bit(packed, state).float().reshape(w.shape))


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("in_f, group", [(96, 64), (100, 32), (48, 128)])
def test_int4_groups_pad_the_width(in_f, group, symmetric):
    """K = 96, g = 64: codes of the padded [out, 128], a scale per padded group, the padded codes are the
    zero point (weight 0), the last group's qparams are those of its real columns alone, and the cropped
    dequantized weight has the input's shape with each real weight within half its group's step."""
    w = _weights(40, in_f, seed=3)
    w[:7, (in_f // group) * group:] = w[:7, (in_f // group) * group:].abs() + 0.01  # all-positive last groups
    q, scale, zp = P.int4_group_rtn(w, group, symmetric)
    n_groups, kp = -(-in_f // group), -(-in_f // group) * group
    assert q.shape == (40, kp) and scale.shape == zp.shape == (40, n_groups, 1) and P.padded_width(in_f, group) == kp
    assert torch.equal(q[:, in_f:], zp[:, -1].expand(40, kp - in_f))
    last = (n_groups - 1) * group
    _, s_last, z_last = _old_int4_group_rtn(w[:, last:], in_f - last, symmetric)  # the real columns as one group
    assert torch.equal(scale[:, -1], s_last[:, 0]) and torch.equal(zp[:, -1], z_last[:, 0])
    wq = P.int4_group_dequantize(q, scale, zp, in_f)
    assert wq.shape == w.shape
    assert torch.equal(P.int4_group_dequantize(q, scale, zp)[:, in_f:], torch.zeros(40, kp - in_f))
    step = scale.abs().repeat_interleave(group, dim=1)[:, :in_f, 0]
    err = (w - wq).abs()
    if symmetric:  # codes reach 7 steps on the extreme's other side: beyond, within one step
        assert (err <= step * (1 + 1e-5)).all()
        err = torch.where(w.abs() <= 7 * step, err, torch.zeros_like(err))
    assert (err <= step / 2 * (1 + 1e-5) + 1e-8).all()


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_gptq_pads_the_width(symmetric):
    """GPTQ on K = 96, g = 64: padded codes/scales like RTN, cropped weight; with a diagonal Hessian
    no error is propagated, so it is RTN exactly."""
    w = _weights(24, 96, seed=4)
    codes, scale, zp = P.gptq_int4_codes(w, torch.eye(96) * 3.0, 64, symmetric)
    rtn = P.int4_group_rtn(w, 64, symmetric)
    assert codes.shape == (24, 128) and scale.shape == (24, 2, 1)
    for a, b in zip((codes, scale, zp), rtn):
        assert torch.equal(a, b)
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(5))
    wq = P.gptq_int4(w, x.T @ x, 64, symmetric)
    assert wq.shape == w.shape and torch.isfinite(wq).all()
    assert (x @ (w - wq).T).pow(2).mean() <= (x @ (w - P.int4_group_dequantize(*rtn, 96)).T).pow(2).mean()


def test_hqq_pads_the_width():
    pytest.importorskip("onnxruntime")
    w = _weights(32, 96, seed=6)
    wq = P.hqq_int4(w, 64)
    assert wq.shape == w.shape and torch.isfinite(wq).all()
    assert 10 * math.log10(w.pow(2).sum() / (w - wq).pow(2).sum()) > 15.0


@pytest.mark.parametrize("shape", [(160, 96), (7, 96), (96, 160)], ids=str)
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bnb_4bit_any_width(shape, quant_type):
    """bitsandbytes' blocks run over the flattened weight (the last one partial): each block's values stay
    within its absmax. Its CPU backend got a 2-D [160, 96] wrong (12 dB); bnb_4bit_fake flattens first."""
    pytest.importorskip("bitsandbytes")
    w = _weights(*shape, seed=7)
    wq = P.bnb_4bit_fake(w, quant_type, 64)
    assert wq.shape == w.shape
    flat, qflat = w.reshape(-1), wq.reshape(-1)
    for i in range(0, flat.numel(), 64):
        assert qflat[i:i + 64].abs().max() <= flat[i:i + 64].abs().max() * (1 + 1e-6)
    assert 10 * math.log10(w.pow(2).sum() / (w - wq).pow(2).sum()) > (18.0 if quant_type == "nf4" else 14.0)


def test_int8_groups_pad_the_width():
    w = _weights(16, 96, seed=8)
    wq = P.fake_quantize_weight(w, "per_group", 8, False, 64)
    scale, _ = P.weight_qparams(w, "per_group", 0, 255, False, 64)
    assert wq.shape == w.shape and scale.shape == (16, 2, 1)
    step = scale.repeat_interleave(64, dim=1)[:, :96, 0]
    assert ((w - wq).abs() <= step / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("scale_shape", [(), (16, 1), (16, 4, 1)], ids=["per-tensor", "per-channel", "per-group"])
def test_fake_quantize_in_place_is_bit_identical_and_leaves_its_input(scale_shape):
    """The in-place path (one temporary) computes exactly what the chained operations (the autograd path) do."""
    from ffnquant.numerics.primitives import fake_quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 4, 8, generator=g) if len(scale_shape) == 3 else torch.randn(16, 32, generator=g)
    scale = torch.rand(scale_shape, generator=g) * 0.05 + 0.01
    zp = torch.randint(0, 255, scale_shape, generator=g)
    before = x.clone()
    fast = fake_quantize(x, scale, zp, 0, 255)
    chained = fake_quantize(x.clone().requires_grad_(), scale, zp, 0, 255)
    assert torch.equal(fast, chained.detach()) and torch.equal(x, before)


@pytest.mark.parametrize("value, dtype, want", [
    (1.0, torch.float32, True), (float("nan"), torch.float32, False), (float("inf"), torch.float32, False),
    (float("-inf"), torch.bfloat16, False), (float("nan"), torch.float16, False), (2.0, torch.bfloat16, True),
], ids=["finite", "nan", "inf", "minus-inf-bf16", "nan-fp16", "finite-bf16"])
def test_all_finite_finds_any_non_finite_value(value, dtype, want):
    x = torch.randn(64, 33).to(dtype)
    x[17, 5] = value
    assert P.all_finite(x) is want


@pytest.mark.parametrize("x", [torch.empty(0, 4), torch.arange(6)], ids=["empty", "integer"])
def test_all_finite_holds_for_empty_and_integer_tensors(x):
    assert P.all_finite(x) is True
