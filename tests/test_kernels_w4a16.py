"""The Triton W4A16 kernel against its torch reference, under Triton's CPU interpreter (and on CUDA when present).

TRITON_INTERPRET is set per test (monkeypatch), not for the whole process: the kernel module
decorates its kernels lazily per mode, so the variable only has to be set before the launch,
and other test modules keep seeing the environment they expect.

Tolerance (derived, not tuned). Kernel and reference multiply x by the same weights:
w = (q - 8) * s with s the stored scale, every term exact in float32. Both then evaluate the
same exact sum S = sum_k x_k w_k in float32, in different orders (the kernel sums x_k (q_k - 8)
per group and multiplies by s once). Any order of a K-term float32 sum of rounded products is
within gamma_{K+2} * sum_k |x_k w_k| of S, gamma_n = n u / (1 - n u), u = 2**-24 (one more
rounding for the scale product), so the two float32 results differ by at most twice that.
Each is then rounded to the output dtype (half an ulp each), so outputs differ by at most
2 * gamma_{K+2} * sum|x||w| + ulp(|y|). On a GPU the tensor cores' float32 accumulation is
not IEEE round-to-nearest, so the GPU test takes u = 2**-23.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from kernel_checks import assert_within, random_x

pytest.importorskip("triton", reason="the W4A16 kernel tests need triton")

from ffnquant.errors import FFNQuantError  # noqa: E402
from ffnquant.kernels.w4a16 import (  # noqa: E402
    ACTIVATIONS,
    KernelConfig,
    PackedW4,
    W4A16Linear,
    _candidates,
    dequantize_w4,
    pack_w4,
    triton_status,
    w4a16_config_used,
    w4a16_gated,
    w4a16_gated_reference,
    w4a16_matmul,
    w4a16_reference,
)
from ffnquant.model import ACTIVATIONS as FFN_ACTIVATIONS  # noqa: E402
from ffnquant.numerics.primitives import int4_group_dequantize, int4_group_rtn  # noqa: E402
from ffnquant.spec import Activation  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
SHAPES = {"k256-n96": (256, 96), "k384-n100": (384, 100)}  # n=100: not a multiple of any BLOCK_N


def _ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at |y| (at least its smallest subnormal step)."""
    fi = torch.finfo(dtype)
    mag = y.abs().clamp(min=fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def _bound(x: torch.Tensor, p: PackedW4, ref: torch.Tensor, out_dtype: torch.dtype, u: float = 2.0**-24):
    """2 * gamma_{K+2} * sum|x||w| + one ulp of the output dtype at |y| (see the module docstring)."""
    n_terms = p.k + 2
    gamma = n_terms * u / (1 - n_terms * u)
    absdot = x.float().abs() @ dequantize_w4(p).abs().to(x.device).T
    return 2 * gamma * absdot + _ulp(ref.float(), out_dtype)


def _packed(n: int, k: int, g: int, seed: int = 0, scale_dtype=torch.float16) -> PackedW4:
    gen = torch.Generator().manual_seed(seed)
    return pack_w4(torch.randn(n, k, generator=gen) * 0.05, g, scale_dtype)


# --- kernel vs reference ---------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("group", [32, 128], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("m", [1, 3, 16, 33], ids=lambda m: f"m{m}")
def test_matmul_matches_reference(interpret, m, group, dtype, shape):
    k, n = shape
    p = _packed(n, k, group)
    x = random_x(m, k, dtype)
    y = w4a16_matmul(x, p)
    ref = w4a16_reference(x, p)
    assert y.dtype == dtype and y.shape == (m, n)
    assert_within(y, ref, _bound(x, p, ref, dtype))


@pytest.mark.parametrize("m", [1, 5], ids=lambda m: f"m{m}")
def test_every_candidate_config(interpret, m):
    # the configs the CUDA tuner may pick (split K with atomics, K steps larger than K, several groups per step)
    k, n, group = 384, 100, 128
    p = _packed(n, k, group)
    x = random_x(m, k, torch.float16)
    ref = w4a16_reference(x, p)
    bound = _bound(x, p, ref, torch.float16)
    configs = _candidates(m, p, gated=False)
    assert 1 <= len(configs) <= 8
    assert any(c.split_k > 1 for c in configs)
    for cfg in configs:
        assert_within(w4a16_matmul(x, p, config=cfg), ref, bound)


@pytest.mark.parametrize("group", [8, 32, 64], ids=lambda g: f"g{g}")
def test_gemv_small_and_odd_groups(interpret, group):
    # group 8 has no dot path (depth < 16): every M runs the gemv kernel; 96 is not a power of two
    k, n = 192, 40
    p = _packed(n, k, group)
    for m in (1, 4):
        x = random_x(m, k, torch.float16)
        ref = w4a16_reference(x, p)
        assert_within(w4a16_matmul(x, p), ref, _bound(x, p, ref, torch.float16))
    p96 = _packed(n, 192, 96)
    x = random_x(3, 192, torch.float32)
    ref = w4a16_reference(x, p96)
    assert_within(w4a16_matmul(x, p96), ref, _bound(x, p96, ref, torch.float32))


def test_fp32_scales_and_strided_input(interpret):
    p = _packed(64, 256, 64, scale_dtype=torch.float32)
    xt = random_x(256, 6, torch.float16).T  # [6, 256] with stride (1, 6): the wrapper makes it contiguous
    ref = w4a16_reference(xt, p)
    assert_within(w4a16_matmul(xt, p), ref, _bound(xt, p, ref, torch.float16))


def test_empty_batch(interpret):
    p = _packed(32, 64, 32)
    y = w4a16_matmul(torch.zeros(0, 64, dtype=torch.float16), p)
    assert y.shape == (0, 32) and y.dtype == torch.float16


def test_config_used_in_interpreter(interpret):
    p = _packed(32, 256, 128)
    assert w4a16_config_used(random_x(1, 256, torch.float16), p).path == "gemv"
    assert w4a16_config_used(random_x(8, 256, torch.float16), p).path == "dot"


# --- gated (gate + up in one launch) ---------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-z) -> inf gives the exact limit 0
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("m", [1, 5], ids=lambda m: f"m{m}")
def test_gated_matches_reference(interpret, m, act):
    k, n = 256, 48
    pg, pu = _packed(n, k, 64, seed=2), _packed(n, k, 64, seed=3)
    x = random_x(m, k, torch.float16) * 4  # pre-activations of a few units: both tails of each activation
    ref = w4a16_gated_reference(x, pg, pu, act)
    y = w4a16_gated(x, pg, pu, act)
    xf = x.float()
    g, u = xf @ dequantize_w4(pg).T, xf @ dequantize_w4(pu).T
    gamma = (k + 2) * 2.0**-24
    e_g = 2 * gamma * (xf.abs() @ dequantize_w4(pg).abs().T)
    e_u = 2 * gamma * (xf.abs() @ dequantize_w4(pu).abs().T)
    a = FFN_ACTIVATIONS[Activation(act)](g)  # the FFN's own definition
    lip = 1.13  # the largest slope of these activations (gelu: 1.129; silu: 1.0998; the others <= 1)
    # error of g and u carried through act(g) * u, plus a few float32 ulps for the activation's own evaluation
    # (Triton's exp/erf vs torch's; gelu_tanh is evaluated as z * sigmoid(2u), equal to torch's formula in exact math)
    bound = lip * e_g * u.abs() + (a.abs() + lip * e_g) * e_u + 16 * 2.0**-24 * (g.abs() + 1) * u.abs()
    bound = bound + _ulp(ref.float(), torch.float16)
    assert_within(y, ref, bound)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_gated_candidate_configs(interpret):
    # the tuner's gated candidates are the plain ones without a K split; each must run and match
    k, n = 256, 48
    pg, pu = _packed(n, k, 128, seed=2), _packed(n, k, 128, seed=3)
    x = random_x(5, k, torch.float16)
    ref = w4a16_gated_reference(x, pg, pu, "relu")
    configs = _candidates(5, pg, gated=True)
    assert configs and all(c.split_k == 1 for c in configs)
    xf = x.float()
    g, u = xf @ dequantize_w4(pg).T, xf @ dequantize_w4(pu).T
    e = 2 * (k + 2) * 2.0**-24
    e_g, e_u = e * (xf.abs() @ dequantize_w4(pg).abs().T), e * (xf.abs() @ dequantize_w4(pu).abs().T)
    bound = e_g * u.abs() + (g.abs() + e_g) * e_u + _ulp(ref.float(), torch.float16)  # relu: slope 1, exact
    for cfg in configs:
        assert_within(w4a16_gated(x, pg, pu, "relu", config=cfg), ref, bound)


def test_gated_rejects_mismatch_and_split(interpret):
    pg, pu = _packed(48, 256, 64), _packed(48, 256, 32)
    x = random_x(1, 256, torch.float16)
    with pytest.raises(FFNQuantError, match="share shape"):
        w4a16_gated(x, pg, pu, "silu")
    with pytest.raises(FFNQuantError, match="unknown activation"):
        w4a16_gated(x, pg, pg, "swish")
    with pytest.raises(FFNQuantError, match="split"):
        w4a16_gated(x, pg, pg, "silu", config=KernelConfig("gemv", 1, 16, 256, split_k=2))


# --- packing numerics ------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 128], ids=lambda g: f"g{g}")
def test_pack_matches_ffnquant_int4_group_rtn(group):
    w = torch.randn(24, 256) * torch.logspace(-3, 1, 24).unsqueeze(1)
    w[3, :group] = 0.0  # an all-zero group: scale 1
    q, scale, zp = int4_group_rtn(w, group, symmetric=True)
    expect = int4_group_dequantize(q, scale, zp)
    # float32 scales: bit for bit the preset
    p32 = pack_w4(w, group, scale_dtype=torch.float32)
    assert torch.equal(dequantize_w4(p32), expect)
    # float16 scales: the same codes, the scale rounded to fp16 (the numerics of record)
    p16 = pack_w4(w, group)
    assert p16.scales.dtype == torch.float16 and p16.packed.dtype == torch.uint8
    assert torch.equal(dequantize_w4(p16), int4_group_dequantize(q, scale.half().float(), zp))
    # so each weight moves by at most |q - 8| <= 8 times the scale's fp16 rounding (half an ulp, relative 2**-11)
    s = scale.abs().expand(-1, -1, group).reshape(24, 256)
    assert ((dequantize_w4(p16) - expect).abs() <= 8 * (s * 2.0**-11 + 2.0**-25)).all()


def test_pack_layout_and_nbytes():
    w = torch.randn(8, 64)
    p = pack_w4(w, 32)
    q, _, _ = int4_group_rtn(w, 32, symmetric=True)
    assert p.packed.shape == (8, 32) and p.scales.shape == (8, 2)
    assert torch.equal((p.packed & 0xF).int(), q[:, 0::2]) and torch.equal((p.packed >> 4).int(), q[:, 1::2])
    assert p.nbytes == 8 * 32 + 8 * 2 * 2
    assert (p.n, p.k, p.group_size) == (8, 64, 32)


@pytest.mark.parametrize(
    "shape,group,match",
    [
        ((8, 64), 33, "positive multiple of 8"),
        ((8, 64), 4, "positive multiple of 8"),
        ((8, 64), 0, "positive multiple of 8"),
        ((8, 64), -32, "positive multiple of 8"),
        ((8, 96), 64, "must divide the input dimension 96"),
        ((64,), 32, "2-D floating"),
    ],
    ids=["odd", "not-multiple-of-8", "zero", "negative", "not-dividing-k", "1-d-weight"],
)
def test_pack_rejects_bad_shapes_and_groups(shape, group, match):
    with pytest.raises(FFNQuantError, match=match):
        pack_w4(torch.randn(*shape), group)


def test_pack_rejects_int_weight_scale_dtype_and_overflow():
    with pytest.raises(FFNQuantError, match="2-D floating"):
        pack_w4(torch.ones(8, 64, dtype=torch.int32), 32)
    with pytest.raises(FFNQuantError, match="unknown scale dtype"):
        pack_w4(torch.randn(8, 64), 32, scale_dtype=torch.float64)
    with pytest.raises(FFNQuantError, match="overflows"):
        pack_w4(torch.full((8, 64), 1e6), 32)
    assert pack_w4(torch.full((8, 64), 1e6), 32, scale_dtype=torch.float32).scales.dtype == torch.float32


def test_matmul_rejects_bad_inputs(interpret):
    p = _packed(32, 64, 32)
    with pytest.raises(FFNQuantError, match="features"):
        w4a16_matmul(torch.randn(2, 128, dtype=torch.float16), p)
    with pytest.raises(FFNQuantError, match="float16, bfloat16 or float32"):
        w4a16_matmul(torch.ones(2, 64, dtype=torch.int32), p)
    with pytest.raises(FFNQuantError, match="2-D"):
        w4a16_matmul(torch.randn(2, 3, 64), p)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(FFNQuantError, match="TRITON_INTERPRET=1"):
        w4a16_matmul(torch.randn(1, 64), _packed(32, 64, 32))


# --- module ----------------------------------------------------------------------------


def test_linear_with_bias_and_3d_input(interpret):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 40)
    layer = W4A16Linear(lin, group_size=64).half()
    # .half() casts the bias but keeps the scales (numerics of record) and codes as they are
    assert layer.scales.dtype == torch.float16 and layer.packed.dtype == torch.uint8
    assert layer.bias.dtype == torch.float16
    layer32 = W4A16Linear(lin, group_size=64, scale_dtype=torch.float32).to(dtype=torch.bfloat16)
    assert layer32.scales.dtype == torch.float32
    x = random_x(6, 128, torch.float16).reshape(2, 3, 128)
    y = layer(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float16
    p = layer.weight_packed
    x2 = x.reshape(6, 128)
    ref = (x2.float() @ dequantize_w4(p).T + layer.bias.float()).half()
    # the kernel's bound, then the bias add in fp16 (one more rounding: half an ulp, within one ulp of y)
    bound = _bound(x2, p, ref, torch.float16) + _ulp(ref.float(), torch.float16)
    assert_within(y.reshape(6, 40), ref, bound)
    no_bias = W4A16Linear(torch.nn.Linear(128, 40, bias=False), group_size=32)
    assert no_bias.bias is None and no_bias(x).shape == (2, 3, 40)
    assert "group_size=64" in repr(layer)


def test_linear_rejects_non_linear():
    with pytest.raises(FFNQuantError, match="nn.Linear"):
        W4A16Linear(torch.nn.Conv1d(4, 4, 1), group_size=32)


# --- environment -----------------------------------------------------------------------


def test_triton_status_reasons(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, why = triton_status()
    assert ok and "interpreter" in why
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ok, why = triton_status()
    assert not ok and "no CUDA device" in why and "TRITON_INTERPRET" in why
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton now raises ImportError
    ok, why = triton_status()
    assert not ok and "triton is not installed" in why


# --- CUDA (skipped without a GPU) --------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", [1, 4, 16, 100], ids=lambda m: f"m{m}")
def test_cuda_matches_reference(monkeypatch, m, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    k, n = 4096, 1000
    p = _packed(n, k, 128).to("cuda")
    x = random_x(m, k, dtype).cuda()
    ref = w4a16_reference(x, p)
    bound = _bound(x, p, ref, dtype, u=2.0**-23)
    assert_within(w4a16_matmul(x, p), ref, bound)  # tuned config
    if dtype == torch.float16:  # every config once (each is a compile): fp16 only
        for cfg in _candidates(m, p, gated=False):
            assert_within(w4a16_matmul(x, p, config=cfg), ref, bound)
    assert w4a16_config_used(x, p) is not None
    if m <= 16:
        pu = _packed(n, k, 128, seed=5).to("cuda")
        yg = w4a16_gated(x, p, pu, "relu")
        # relu is exact: the gated output is relu(g) * u from float32 sums bounded as above
        g = x.float() @ dequantize_w4(p).cuda().T
        u = x.float() @ dequantize_w4(pu).cuda().T
        e = 2 * (k + 2) * 2.0**-23
        eg = e * (x.float().abs() @ dequantize_w4(p).abs().cuda().T)
        eu = e * (x.float().abs() @ dequantize_w4(pu).abs().cuda().T)
        refg = (torch.relu(g) * u).to(dtype)
        assert_within(yg, refg, eg * u.abs() + (g.abs() + eg) * eu + _ulp(refg.float(), dtype))
    assert math.isfinite(float(w4a16_matmul(x, p).float().sum()))
