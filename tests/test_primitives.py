"""Primitives: quantization error bounds (hypothesis), int4 packing, hand-derived cases, format round trips."""

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ffnquant import primitives as P
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
