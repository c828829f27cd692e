"""The fused activation quantization kernels and modules against the unfused torch path, under Triton's CPU
interpreter (and on CUDA when present).

TRITON_INTERPRET is set per test (monkeypatch), as in test_kernels_w4a16: the kernels are decorated per mode.

What must be exact. `quantize_rows` and `rescale_int8` do the same float32 operations as torch_rt's
`int8_symmetric_rows` / `fp8_rowwise` / Int8DynamicLinear's rescale, each correctly rounded, so codes, scales and
outputs are compared bit for bit. So is the fused hidden whenever the activation is exact (relu, identity) and
the FFN modules then (reglu), and any module output whose hidden codes and scales came out identical.

Tolerance where the activation is evaluated (derived, not tuned). The kernel and torch evaluate silu, gelu,
gelu_tanh, sigmoid on the same float32 input g with different exp / erf / tanh implementations, each within a
few ulps, so |a - a_ref| <= da = 16 * 2**-24 * (|g| + 1) (absolute in |g| + 1: 1 + erf(z) and 1 + exp(-z) lose
relative accuracy, not absolute). Rounding a to the activation dtype D then moves the two by at most one more
ulp_D (they straddle at most one rounding boundary), and the gated product h = D(a * u) adds |u| times that plus
one ulp_D(h): eps_h. The row scale (absmax / Q, Q = 127 or 448, correctly rounded) then differs by at most
max(eps_h) / Q + ulp(s), and v = h / s by dv = eps_h / s + |v| ds / s + 2 ulp(v). A code may differ only where
v_ref lies within dv of a rounding boundary of the code grid (k + 1/2 for int8, the midpoints between e4m3fn
values for fp8), and then by one step. A module's output then differs by what those codes change:
s_col * |sum_k (s q_k - s_ref q_ref_k) w_k|, plus the float32 GEMM's summation error on each side
(2 gamma_{K+2} s_col sum_k |s q_k w_k|, for fp8) and at most three roundings per side after the sum (the GEMM's
output dtype, the activation dtype, the bias add): 3 ulp of the coarsest dtype at |y|, per side.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the activation quantization kernels need triton")

from ffnquant.errors import FFNQuantError  # noqa: E402
from ffnquant.kernels.actquant import (  # noqa: E402
    ACTIVATIONS,
    KINDS,
    act_mul_quantize,
    act_mul_quantize_reference,
    hidden_reference,
    quantize_rows,
    quantize_rows_reference,
    rescale_int8,
    rescale_int8_reference,
)
from ffnquant.kernels.actquant_ffn import (  # noqa: E402
    FusedFp8DenseFFN,
    FusedFp8GatedFFN,
    FusedInt8DenseFFN,
    FusedInt8GatedFFN,
    fused_ffn,
)
from ffnquant.kernels.w4a16_pack import torch_act  # noqa: E402
from ffnquant.model import build  # noqa: E402
from ffnquant.runtimes.torch_rt import unfused_ffn  # noqa: E402
from ffnquant.spec import FFNSpec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EXACT_ACTS = ("relu", "identity")
Q = {"int8": 127.0, "fp8": 448.0}


def _ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at |y| (at least its smallest subnormal step), float64."""
    fi = torch.finfo(dtype)
    mag = y.double().abs().clamp(min=fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q


def _assert_same(q, s, qr, sr):
    assert q.dtype == qr.dtype and q.shape == qr.shape and s.shape == sr.shape and s.dtype == torch.float32
    assert torch.equal(_bits(q), _bits(qr)), f"{int((_bits(q) != _bits(qr)).sum())} codes differ"
    assert torch.equal(s, sr)


def _x(m: int, k: int, dtype, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * scale).to(dtype)


# --- quantize_rows ------------------------------------------------------------------------


@pytest.mark.parametrize("k", [48, 200], ids=lambda k: f"k{k}")
@pytest.mark.parametrize("m", [1, 5, 16, 33], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rows_matches_torch(interpret, kind, dtype, m, k):
    # k = 48: one masked step of the interpreter's 64; k = 200: a loop of four, the last one masked
    x = _x(m, k, dtype, seed=m + k)
    x[0, k // 3] = torch.finfo(dtype).max  # one huge value: every other code of the row rounds to (nearly) 0
    if m > 1:
        x[1] = 0  # absmax 0: the scale is the clamp's (1e-12 / 127, or 1e-12 for fp8)
    if m > 2:  # values below the 1e-12 clamp (fp16's smallest subnormals otherwise): the clamp orders differ
        x[2] = (torch.arange(k) - k // 2).to(dtype) * (3e-15 if dtype != torch.float16 else 6e-8)
    q, s = quantize_rows(x, kind)
    _assert_same(q, s, *quantize_rows_reference(x, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rows_scale_on_a_gpu_is_torchs_cuda_division(interpret, kind):
    """On a GPU torch divides by the Python scalar 127 (448) as a product with its float32 reciprocal, so the
    kernel does too there (RECIP, set from the tensors' device): that path, run in the interpreter, against torch's
    product on the CPU. Rows whose IEEE quotient and reciprocal product differ in their last bit are included."""
    from ffnquant.kernels.actquant import _inv_q, _kernels

    fp8 = kind == "fp8"
    inv = _inv_q(fp8)
    x = _x(256, 48, torch.float32, seed=11)
    x[:, 0] = torch.linspace(20.0, 440.0, 256)  # each row's absmax: about 5% of such scales differ in the last bit
    amax = x.abs().amax(dim=-1, keepdim=True)
    scale = (amax * inv).clamp(min=1e-12) if fp8 else amax.clamp(min=1e-12) * inv
    assert not torch.equal(scale, (amax / (448.0 if fp8 else 127.0)).clamp(min=1e-12)), "no row tells the two apart"
    codes = (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn) if fp8 else torch.round(x / scale).to(torch.int8)
    q = torch.empty_like(codes).view(torch.uint8) if fp8 else torch.empty_like(codes)
    s = torch.empty(256, dtype=torch.float32)
    _kernels(True).rows[(256,)](x, q, s, 256, 48, x.stride(0), q.stride(0), inv, FP8=fp8, RECIP=True, BLOCK=64)
    _assert_same(q.view(torch.float8_e4m3fn) if fp8 else q, s.unsqueeze(-1), codes, scale)


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_rows_pads_rows_and_takes_strided_input(interpret, kind):
    x = _x(40, 5, torch.float16).T  # [5, 40], stride (1, 5)
    q, s = quantize_rows(x, kind, pad_to=16, min_rows=17)  # max(16, 17) rows
    qr, sr = quantize_rows_reference(x, kind)
    assert q.shape == (17, 40) and s.shape == (17, 1)
    _assert_same(q[:5], s[:5], qr, sr)
    assert not _bits(q[5:]).any() and torch.equal(s[5:], torch.ones(12, 1))
    q, s = quantize_rows(x[:0], kind, pad_to=16)
    assert q.shape == (0, 40) and s.shape == (0, 1)


def test_fp8_codes_match_torch_on_every_bf16_value_and_each_tie(interpret):
    """Scale exactly 1 (each row starts with 448), so the codes are fp8(v) of the values themselves: every finite
    bf16 value in [-448, 448], each midpoint between adjacent e4m3fn values and its float32 neighbours, and random
    float32 values. (All 2**31 float32 values in [-448, 448] were also checked once, offline, against torch's
    conversion with a numpy copy of the kernel's bit arithmetic: no difference.)"""
    bf = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    fp8 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (fp8[1:] + fp8[:-1]) / 2
    ties = torch.cat([mid, torch.nextafter(mid, mid + 1), torch.nextafter(mid, mid - 1)])
    gen = torch.Generator().manual_seed(0)
    rand = torch.exp2(torch.rand(8192, generator=gen) * 24 - 15) * torch.sign(torch.randn(8192, generator=gen))
    v = torch.cat([bf, ties, -ties, rand, torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-10), 2.0**-7 * 1.5])])
    v = v[torch.isfinite(v) & (v.abs() <= 448)]
    v = torch.cat([v, torch.zeros((-v.numel()) % 1023)]).reshape(-1, 1023)
    x = torch.cat([torch.full((v.shape[0], 1), 448.0), v], dim=1)
    q, s = quantize_rows(x, "fp8")
    assert torch.equal(s, torch.ones_like(s))
    assert torch.equal(q.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_int8_codes_round_half_even_like_torch(interpret):
    half = torch.arange(-127, 127, dtype=torch.float32) + 0.5
    gen = torch.Generator().manual_seed(1)
    v = torch.cat([half, torch.nextafter(half, half + 1), torch.nextafter(half, half - 1),
                   torch.rand(500, generator=gen) * 254 - 127])
    x = torch.cat([torch.full((1,), 127.0), v]).reshape(1, -1)  # scale exactly 1
    q, s = quantize_rows(x, "int8")
    _assert_same(q, s, *quantize_rows_reference(x, "int8"))
    assert torch.equal(q[0, 1:255].float(), torch.round(half))


# --- the fused hidden ---------------------------------------------------------------------


def _first_gemm_output(src: str, m: int, f: int, gated: bool, seed: int = 3):
    """A gate|up GEMM output: int32 accumulators with row and column scales, or a bf16 output, plus a bias."""
    n = 2 * f if gated else f
    gen = torch.Generator().manual_seed(seed)
    if src == "int32":
        y = torch.randint(-40000, 40000, (m, n), generator=gen, dtype=torch.int32)
        rs = torch.rand(m, 1, generator=gen) * 1e-4 + 1e-5
        cs = torch.rand(n, generator=gen) * 1e-3 + 1e-4
    else:
        y, rs, cs = (torch.randn(m, n, generator=gen) * 4).to(torch.bfloat16), None, None
    bias = torch.randn(n, generator=gen) * 0.5
    return y, rs, cs, bias


def _boundary_distance(v: torch.Tensor, kind: str) -> torch.Tensor:
    """Distance of |v| to the nearest rounding boundary of the code grid."""
    if kind == "int8":
        b = torch.arange(127, dtype=torch.float64) + 0.5
    else:
        vals = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
        b = (vals[1:] + vals[:-1]) / 2
    a = v.double().abs().reshape(-1)
    b = b.to(a.device)
    i = torch.searchsorted(b, a).clamp(1, b.numel() - 1)
    return torch.minimum((a - b[i - 1]).abs(), (a - b[i]).abs()).reshape(v.shape)


def _code_values(q: torch.Tensor) -> torch.Tensor:
    return q.double()  # int8 codes, or the e4m3fn values (so +0 and -0 compare equal)


def _assert_codes_agree(q, s, qr, sr, h_ref, eps_h, kind):
    """The derived check of the module docstring: scales within ds, codes equal away from rounding boundaries."""
    assert q.shape == qr.shape and s.shape == sr.shape
    s, sr = s.double(), sr.double()
    ds = eps_h.amax(dim=1, keepdim=True) / Q[kind] + _ulp(sr, torch.float32)
    assert ((s - sr).abs() <= ds).all(), f"scale off by {(s - sr).abs().max().item():.3g}"
    v_ref = h_ref.double() / sr
    dv = eps_h / sr + v_ref.abs() * ds / sr + 2 * _ulp(v_ref, torch.float32)
    c, cr = _code_values(q), _code_values(qr)
    differ = c != cr
    assert not (differ & (_boundary_distance(v_ref, kind) > dv)).any(), "a code differs away from a rounding boundary"
    step = 1.0 if kind == "int8" else torch.maximum(2.0 ** (torch.floor(torch.log2(cr.abs().clamp(min=2.0**-6))) - 3),
                                                     torch.full_like(cr, 2.0**-9))
    assert ((c - cr).abs() <= step).all(), "a code differs by more than one step"


def _hidden_eps(g, u, act: str, dtype, dg=0.0, du=0.0) -> torch.Tensor:
    """eps_h of the module docstring from the activation input g and the up projection u (None: dense); dg and
    du bound differences of g and u themselves (GEMM summation order), carried through the activation's largest
    slope (1.13: gelu 1.129, silu 1.0998, the others <= 1)."""
    g = g.double()
    a = torch_act(act)(g).abs()
    da = 16 * 2.0**-24 * (g.abs() + 1) + 1.13 * dg
    if dtype != torch.float32:
        da = da + _ulp(2 * (a + da), dtype)
    if u is None:
        return da
    u = u.double().abs()
    return da * (u + du) + a * du + _ulp(2 * (a + da) * (u + du), dtype)


SOURCES = {"int32-fp32": ("int32", torch.float32), "int32-bf16": ("int32", torch.bfloat16),
           "bf16-bf16": ("bf16", torch.bfloat16), "bf16-fp16": ("bf16", torch.float16)}


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-z) -> inf gives the exact limit 0
@pytest.mark.parametrize("source", SOURCES.values(), ids=SOURCES.keys())
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_hidden_matches_act_mul_then_torch_quantizer(interpret, kind, act, source):
    src, dtype = source
    m, f = 5, 80  # f: a loop of two interpreter steps, the second masked
    y, rs, cs, bias = _first_gemm_output(src, m, f, gated=True)
    kw = dict(gated=True, row_scale=rs, col_scale=cs, bias=bias, dtype=dtype)
    q, s = act_mul_quantize(y, kind, act, **kw)
    qr, sr = act_mul_quantize_reference(y, kind, act, **kw)
    if act in EXACT_ACTS:
        _assert_same(q, s, qr, sr)
        return
    one = dict(gated=False, row_scale=rs, dtype=dtype)
    g = hidden_reference(y[:, :f], "identity", col_scale=None if cs is None else cs[:f], bias=bias[:f], **one)
    u = hidden_reference(y[:, f:], "identity", col_scale=None if cs is None else cs[f:], bias=bias[f:], **one)
    h = hidden_reference(y, act, **kw)
    _assert_codes_agree(q, s, qr, sr, h, _hidden_eps(g, u, act, dtype), kind)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("kind", KINDS)
def test_hidden_rounds_where_the_unfused_path_rounds(interpret, kind, act, dtype):
    """Exact, with the activation evaluated as the interpreter evaluates it (numpy's float32 exp, IEEE division):
    what remains is where the kernel rounds to the activation dtype, which must be where torch does."""
    import numpy as np

    f = 80
    y, rs, cs, bias = _first_gemm_output("int32", 5, f, gated=True, seed=7)
    one = dict(gated=False, row_scale=rs, dtype=dtype)
    g = hidden_reference(y[:, :f], "identity", col_scale=cs[:f], bias=bias[:f], **one)
    u = hidden_reference(y[:, f:], "identity", col_scale=cs[f:], bias=bias[f:], **one)
    g32 = g.float().numpy()
    e = np.exp(-g32)
    a = torch.from_numpy(g32 / (np.float32(1) + e) if act == "silu" else np.float32(1) / (np.float32(1) + e))
    ref = quantize_rows_reference(a.to(dtype) * u, kind)
    _assert_same(*act_mul_quantize(y, kind, act, gated=True, row_scale=rs, col_scale=cs, bias=bias, dtype=dtype), *ref)


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_dense_no_bias_and_padding_rows(interpret, kind):
    y, rs, cs, _ = _first_gemm_output("int32", 7, 96, gated=False)
    kw = dict(gated=False, row_scale=rs, col_scale=cs, dtype=torch.float16)
    q, s = act_mul_quantize(y, kind, "relu", rows=4, min_rows=17, **kw)  # 4 valid rows of 7, 17 rows written
    qr, sr = act_mul_quantize_reference(y, kind, "relu", rows=4, **kw)
    assert q.shape == (17, 96)
    _assert_same(q[:4], s[:4], qr, sr)
    assert not _bits(q[4:]).any() and torch.equal(s[4:], torch.ones(13, 1))
    # sigmoid(0) = 0.5 in the masked lanes of the last step must not reach the absmax
    yb = -_first_gemm_output("bf16", 3, 40, gated=False)[0].abs() - 1  # every sigmoid below 0.27
    q, s = act_mul_quantize(yb, kind, "sigmoid", gated=False)
    h = hidden_reference(yb, "sigmoid", gated=False)
    assert torch.allclose(s, quantize_rows_reference(h, kind)[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rescale_int8_matches_int8_dynamic_linear(interpret, dtype, bias):
    gen = torch.Generator().manual_seed(5)
    acc = torch.randint(-2**30, 2**30, (19, 70), generator=gen, dtype=torch.int32)  # > 2**24: int -> float rounds
    rs, cs = torch.rand(19, 1, generator=gen) * 1e-3, torch.rand(70, generator=gen) * 1e-3
    b = torch.randn(70, generator=gen) if bias else None
    for rows in (17, 1):  # 17 rows of 19 (a padded GEMM's), and a single row (decode: one-row tiles)
        y = rescale_int8(acc, rs, cs, b, rows=rows, dtype=dtype)
        ref = rescale_int8_reference(acc, rs, cs, b, rows=rows, dtype=dtype)
        assert y.dtype == dtype and y.shape == (rows, 70) and torch.equal(y, ref)


# --- modules ------------------------------------------------------------------------------

VARIANTS = {"swiglu": ("swiglu", False), "geglu": ("geglu", False), "reglu-bias": ("reglu", True),
            "gelu-dense-bias": ("gelu", True)}


def _hooked(module, names):
    seen = {}
    for n in names:
        module.taps[n].register_forward_hook(lambda mod, inp, out, n=n: seen.__setitem__(n, out.detach()))
    return seen


def _assert_module_matches(fused, unfused, x, kind, gemm_order=False):
    """The fused module against the unfused torch path (see the module docstring). gemm_order: the gate|up GEMM
    over [Wg; Wu] may sum in another order than the two separate GEMMs (cuBLASLt picks algorithms per shape; on
    CPU torch's fp8 GEMM sums each column alike whatever N, so the CPU tests hold it to exactness)."""
    spec = unfused.spec
    seen = _hooked(unfused, ["hidden", "up"] + (["gate_pre"] if spec.gated else []))
    with torch.no_grad():
        y, y_ref = fused(x), unfused(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    x2 = x.reshape(-1, spec.d_model)
    m = x2.shape[0]
    hq, hs = fused.hidden(x2)
    hq, hs = hq[:m], hs[:m]
    h_ref = seen["hidden"].reshape(m, -1)
    qr, sr = quantize_rows_reference(h_ref, kind)
    if spec.activation.value in EXACT_ACTS and not gemm_order:
        _assert_same(hq, hs, qr, sr)
        assert torch.equal(y, y_ref)
        return
    g = seen["gate_pre" if spec.gated else "up"].reshape(m, -1)
    u = seen["up"].reshape(m, -1) if spec.gated else None
    dg = du = 0.0
    if gemm_order:  # 2 gamma_{K+2} sum|x w| per output, then the bf16 output and dtype roundings on each side
        xq, sx = quantize_rows_reference(x2, kind)
        k_in = spec.d_model + 2
        absdot = sx.double() * (xq.float().double().abs() @ fused.w_in.float().double().abs().T) * \
            fused.s_in.double().reshape(1, -1)
        gu = torch.cat([g, u], dim=1) if spec.gated else g
        dgu = 2 * k_in * 2.0**-24 * absdot + 2 * _ulp(2 * gu.abs(), torch.bfloat16) + 2 * _ulp(2 * gu.abs(), x.dtype)
        dg, du = (dgu[:, : spec.d_ff], dgu[:, spec.d_ff:]) if spec.gated else (dgu, 0.0)
    eps = _hidden_eps(g, u, spec.activation.value, x.dtype, dg, du)
    _assert_codes_agree(hq, hs, qr, sr, h_ref, eps, kind)
    if torch.equal(_bits(hq), _bits(qr)) and torch.equal(hs, sr):
        assert torch.equal(y, y_ref)  # the same hidden: the same down projection, bit for bit
        return
    w = fused.w_out.double() if kind == "int8" else fused.w_out.float().double()  # [d, f] codes
    sw = fused.s_out.double().reshape(1, -1)
    dq = hs.double() * _code_values(hq) - sr.double() * _code_values(qr)
    k = spec.d_ff + 2
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    coarse = torch.bfloat16 if kind == "fp8" or x.dtype == torch.bfloat16 else x.dtype
    yr = y_ref.reshape(m, -1).double()
    bound = (sw * (dq @ w.T).abs() + 2 * gamma * sw * ((hs.double() * _code_values(hq)).abs() @ w.abs().T)
             + 6 * _ulp(yr.abs() * 2, coarse if coarse != torch.float32 else torch.float32))
    err = (y.reshape(m, -1).double() - yr).abs()
    assert (err <= bound).all(), f"output off by {(err - bound).max().item():.3g} past the derived bound"


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("kind", KINDS)
def test_fused_ffn_matches_unfused_torch_path(interpret, kind, variant, dtype):
    name, bias = variant
    model = build(FFNSpec(name, d_model=64, d_ff=96, bias=bias), seed=1)
    fused = fused_ffn(model, kind)
    expect = {("int8", True): FusedInt8GatedFFN, ("int8", False): FusedInt8DenseFFN,
              ("fp8", True): FusedFp8GatedFFN, ("fp8", False): FusedFp8DenseFFN}[kind, model.spec.gated]
    assert type(fused) is expect
    x = _x(6, 64, dtype, seed=2, scale=2.0).reshape(2, 3, 64)
    _assert_module_matches(fused, unfused_ffn(model, kind, dtype=dtype), x, kind)


@pytest.mark.parametrize("kind", KINDS)
def test_fused_ffn_cuda_row_padding_fp16_and_dtype_casts(interpret, kind):
    model = build(FFNSpec("reglu", d_model=64, d_ff=96), seed=4)
    fused = fused_ffn(model, kind).half()  # .half() keeps codes, scales and biases as they are
    assert fused.s_in.dtype == torch.float32 and fused.w_in.dtype == (torch.int8 if kind == "int8" else torch.float8_e4m3fn)
    if kind == "int8":
        fused.min_rows = 17  # what CUDA does (cuBLAS int8 needs more than 16 rows), here on CPU
    x = _x(5, 64, torch.float16, seed=6)
    _assert_module_matches(fused, unfused_ffn(model, kind, dtype=torch.float16), x, kind)
    assert fused(x[:0]).shape == (0, 64)
    assert f"kind={kind}" in repr(fused)


# --- errors -------------------------------------------------------------------------------

ERRORS = {
    "int-x": (lambda: quantize_rows(torch.ones(2, 8, dtype=torch.int32), "int8"), "2-D float16, bfloat16 or float32"),
    "1d-x": (lambda: quantize_rows(torch.ones(8), "int8"), "2-D float16, bfloat16 or float32"),
    "unknown-kind": (lambda: quantize_rows(torch.ones(2, 8), "int4"),
                     "unknown activation quantization kind 'int4'; valid: int8, fp8"),
    "bad-pad": (lambda: quantize_rows(torch.ones(2, 8), "fp8", pad_to=0), "pad_to must be an int >= 1"),
    "unknown-act": (lambda: act_mul_quantize(torch.ones(2, 8), "int8", "swish"), "unknown activation 'swish'; valid: silu"),
    "int32-no-scales": (lambda: act_mul_quantize(torch.ones(2, 8, dtype=torch.int32), "int8"),
                        "need row_scale and col_scale"),
    "odd-gated": (lambda: act_mul_quantize(torch.ones(2, 7), "fp8"), "an even count"),
    "bad-col-scale": (lambda: rescale_int8(torch.ones(2, 8, dtype=torch.int32), torch.ones(2), torch.ones(7)),
                      "col_scale must be a float32 tensor of 8 values"),
    "rows-too-many": (lambda: rescale_int8(torch.ones(2, 8, dtype=torch.int32), torch.ones(2), torch.ones(8), rows=3),
                      "rows must be an int in 0..2"),
    "module-x-width": (lambda: fused_ffn(build(FFNSpec("swiglu", d_model=64, d_ff=96)), "int8")(torch.ones(2, 32)),
                       r"x \[..., 64\] in float16, bfloat16 or float32"),
    "module-gated-mismatch": (lambda: FusedFp8GatedFFN(build(FFNSpec("gelu", d_model=64, d_ff=96))), "takes a gated FFN"),
    "module-not-ffn": (lambda: fused_ffn(torch.nn.Linear(4, 4), "fp8"), "wraps an ffnquant FFN"),
    "module-width": (lambda: fused_ffn(build(FFNSpec("swiglu", d_model=64, d_ff=100, multiple_of=1)), "fp8"),
                     "divisible by 16"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_bad_input_raises_a_one_line_error(interpret, case):
    call, match = case
    with pytest.raises(FFNQuantError, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(FFNQuantError, match="TRITON_INTERPRET=1"):
        quantize_rows(torch.ones(2, 8), "int8")


# --- the benchmark ------------------------------------------------------------------------


def _benchmark():
    spec = importlib.util.spec_from_file_location("actquant_kernels_bench", ROOT / "benchmarks" / "actquant_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_benchmark_dry_run_and_refusal_without_cuda(interpret, tmp_path, monkeypatch, capsys):
    bench = _benchmark()
    assert bench.main(["--dry-run", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "actquant_kernels_dry_run.json").read_text())
    assert doc["config"]["dry_run"] and "not a measurement" in doc["stamp"]["label"]
    rows = {(r["tokens"], r["path"]): r for r in doc["rows"]}
    assert set(rows) == {(m, p) for m in (1, 5) for p in bench.PATHS}
    for (m, p), r in rows.items():
        assert not r.get("error") and r["graph_ms"] is None and r["eager_speedup"] is None
        if p.endswith("-fused"):  # the numerics of the unfused path of its kind (up to activation ulps)
            assert abs(r["sqnr_db"] - rows[m, p.replace("-fused", "-unfused")]["sqnr_db"]) < 0.5
    assert "dry run" in (tmp_path / "actquant_kernels_dry_run.md").read_text()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    capsys.readouterr()
    assert bench.main(["--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--dry-run" in err and err.count("\n") == 1


# --- CUDA (skipped without a GPU) ---------------------------------------------------------


def _cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_kernels_match_torch(monkeypatch, kind, dtype):
    _cuda(monkeypatch)
    for m, k in ((1, 4096), (16, 4096), (100, 11008), (2048, 4096)):
        x = _x(m, k, dtype, seed=m).cuda()
        x[0, 7] = 1000.0
        q, s = quantize_rows(x, kind)
        _assert_same(q, s, *quantize_rows_reference(x, kind))
    y, rs, cs, bias = (t.cuda() if t is not None else None for t in _first_gemm_output("int32", 33, 11008, True))
    kw = dict(gated=True, row_scale=rs, col_scale=cs, bias=bias, dtype=dtype)
    _assert_same(*act_mul_quantize(y, kind, "relu", **kw), *act_mul_quantize_reference(y, kind, "relu", **kw))
    acc = torch.randint(-2**20, 2**20, (17, 4096), dtype=torch.int32, device="cuda")
    ref = rescale_int8_reference(acc, rs[:17], cs[:4096], bias[:4096], rows=5, dtype=dtype)
    assert torch.equal(rescale_int8(acc, rs[:17].contiguous(), cs[:4096].contiguous(), bias[:4096].contiguous(),
                                    rows=5, dtype=dtype), ref)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("variant", ["swiglu", "reglu"])
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_modules_match_unfused_and_replay_in_a_graph(monkeypatch, kind, variant):
    _cuda(monkeypatch)
    if kind == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("fp8 GEMMs need compute capability >= 8.9")
    from ffnquant.runtimes.torch_rt import CapturedCall

    model = build(FFNSpec(variant, d_model=256, d_ff=512), seed=3)
    fused = fused_ffn(model, kind, device="cuda")
    for m in (1, 16, 40):
        x = _x(m, 256, torch.bfloat16, seed=m).cuda()
        _assert_module_matches(fused, unfused_ffn(model, kind, device="cuda", dtype=torch.bfloat16), x, kind,
                               gemm_order=kind == "fp8")
        with torch.no_grad():
            eager = fused(x)
        assert torch.equal(CapturedCall(fused, x).replay(), eager)
