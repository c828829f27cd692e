"""Triton kernels that quantize activations per token in one pass over HBM, for the int8 and fp8 GPU paths.

The numerics are those of the unfused torch path (`runtimes.torch_rt`: `Int8DynamicLinear`, w8a8-dynamic-s8,
and `Fp8RowwiseLinear`, fp8-e4m3-dynamic), bit for bit:
- `quantize_rows(x, kind)`: one program per row of x, pass 1 the row's absmax, pass 2 the codes (the second
  read of the row normally hits in L2). Scales in float32 exactly as `int8_symmetric_rows` (max(absmax, 1e-12) / 127)
  and `fp8_rowwise` (max(absmax / 448, 1e-12)) as torch computes them where the tensors are: on a GPU torch
  divides by the Python scalar as a product with its float32 reciprocal, on the CPU (the interpreter) with an IEEE
  division (`div_rn`; Triton's `/` is approximate on GPU); the codes q = v / scale by IEEE division; int8 codes rounded half-even by the 1.5 * 2**23 add; e4m3fn codes built from the float32 bits
  (round-to-nearest-even on the mantissa, subnormals as round(|v| * 512), sign bit 0x80), so they do not depend
  on the hardware's or the interpreter's fp8 conversion. Rows past M (padding for the GEMM) get code 0, scale 1.
- `act_mul_quantize`: the gated FFN's hidden from the gate|up GEMM output (int32 `_int_mm` accumulators with
  row and column scales, or the bf16 output of `_scaled_mm`): h = act(g) * u, then quantized per row for the
  down projection; two passes over the row recompute h instead of storing it.
- `rescale_int8`: the down projection's int32 accumulators * s_row * s_col (+ bias), in the output dtype.
Each intermediate is rounded where the unfused path rounds it: to the activation dtype (`dtype`; float32 keeps
everything in float32) after each GEMM, bias add, activation and product, in the same operation order, with
FP fusion (FMA contraction) off. What can differ from torch is the activation's own float32 evaluation
(Triton's exp/erf against torch's), so silu/gelu/gelu_tanh/sigmoid hiddens may differ by a few ulps.

Triton is imported lazily and the kernels are decorated per mode on first use (as in `w4a16`), so
TRITON_INTERPRET may be set at any time before the first launch in each mode; the jit helpers the kernels
call are decorated per mode too (each mode's kernels see their own helpers through a globals copy).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..errors import FFNQuantError, unknown_choice
from ..numerics.primitives import fp8_rowwise, int8_symmetric_rows
from .tritonenv import import_triton, interpreting, jit_per_mode
from .tritonmath import act, round_to
from .w4a16_pack import ACTIVATIONS, describe, torch_act

__all__ = [
    "ACTIVATIONS",
    "KINDS",
    "act_mul_quantize",
    "act_mul_quantize_reference",
    "hidden_reference",
    "quantize_rows",
    "quantize_rows_reference",
    "rescale_int8",
    "rescale_int8_reference",
]

KINDS = ("int8", "fp8")
_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_DKIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# set by _triton(); the kernel bodies resolve `tl` from their globals
triton = None
tl = None


def _triton():
    global triton, tl
    if tl is None:
        triton, tl = import_triton("the activation quantization kernels")
    return triton


_KERNELS: dict[bool, SimpleNamespace] = {}


def _kernels(interpret: bool) -> SimpleNamespace:
    # decorated per mode on first use, with the helpers the kernels call (`tritonenv.jit_per_mode`)
    if interpret not in _KERNELS:
        jit = jit_per_mode(_triton(), globals(), (round_to, _encode, act, _epilogue, _row_scale))
        # M (valid rows) varies per call: not specialized (M == 1 would otherwise be another compile)
        _KERNELS[interpret] = SimpleNamespace(rows=jit(_rows_kernel, do_not_specialize=["M"]),
                                              hidden=jit(_hidden_kernel, do_not_specialize=["M"]),
                                              rescale=jit(_rescale_kernel, do_not_specialize=["M"]))
    return _KERNELS[interpret]


# --- kernels ------------------------------------------------------------------------------
# 12582912.0 = 1.5 * 2**23: for |v| < 2**22, (v + C) - C is v rounded half-even to an integer (the add lands in a
# binade whose ulp is 1). 0x3C800000 is 2**-6 as float32, e4m3fn's smallest normal; 448 is its largest value
# (primitives.FP8_E4M3_MAX), 127 int8's symmetric limit.


def _encode(v, FP8: tl.constexpr):
    # v = x / scale (float32) -> the int8 code, or the e4m3fn bit pattern as uint8, as torch computes them
    if FP8:
        nan = v != v
        sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
        v = tl.minimum(tl.maximum(v, -448.0), 448.0)
        mag = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20  # mantissa rounded to 3 bits, half-even: exp << 3 | m
        sub = ((mag.to(tl.float32, bitcast=True) * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)  # 0..8
        code = tl.where(mag >= 0x3C800000, normal - 960, sub) | sign  # 960 = (127 - 7) << 3: rebias the exponent
        out = tl.where(nan, 0x7F | sign, code).to(tl.uint8)
    else:
        r = (v + 12582912.0) - 12582912.0
        out = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)
    return out


def _epilogue(y_row, sx, sw_ptr, b_ptr, cols, ok, SRC_INT: tl.constexpr, HAS_BIAS: tl.constexpr,
              DKIND: tl.constexpr):
    # one projection's output as the unfused path holds it: D(acc * sx * sw) or D(bf16 GEMM output), then D(. + D(b))
    if SRC_INT:
        sw = tl.load(sw_ptr + cols, mask=ok, other=0.0)
        v = round_to((tl.load(y_row + cols, mask=ok, other=0).to(tl.float32) * sx) * sw, DKIND)
    else:
        v = round_to(tl.load(y_row + cols, mask=ok, other=0.0).to(tl.float32), DKIND)
    if HAS_BIAS:
        v = round_to(v + round_to(tl.load(b_ptr + cols, mask=ok, other=0.0), DKIND), DKIND)
    return v


def _row_scale(m, inv_q, FP8: tl.constexpr, RECIP: tl.constexpr):
    # the row's float32 scale from its absmax m, as torch computes it on the device the kernel runs on: torch's
    # CUDA division by a Python scalar is a product with its float32 reciprocal (inv_q = fl(1/127) or fl(1/448)),
    # its CPU division (the interpreter's tensors) an IEEE division
    if RECIP:
        if FP8:
            scale = tl.maximum(m * inv_q, 1e-12)
        else:
            scale = tl.maximum(m, 1e-12) * inv_q
    else:
        if FP8:
            scale = tl.maximum(tl.math.div_rn(m, 448.0), 1e-12)
        else:
            scale = tl.math.div_rn(tl.maximum(m, 1e-12), 127.0)
    return scale


def _rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, inv_q, FP8: tl.constexpr, RECIP: tl.constexpr,
                BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    if row >= M:  # padding row of the GEMM input
        for k0 in range(0, K, BLOCK):
            tl.store(q_row + k0 + offs, tl.full([BLOCK], 0, q_ptr.dtype.element_ty), mask=k0 + offs < K)
        tl.store(s_ptr + row, 1.0)
    else:
        x_row = x_ptr + row.to(tl.int64) * stride_xm
        amax = tl.full([BLOCK], 0.0, tl.float32)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(v))
        # tl.reduce with a standard combiner, not tl.max (likewise tl.full, not tl.zeros): see w4a16's comment
        m = tl.reduce(amax, 0, tl.standard._elementwise_max)
        scale = _row_scale(m, inv_q, FP8, RECIP)
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK):
            v = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            tl.store(q_row + k0 + offs, _encode(tl.math.div_rn(v, scale), FP8), mask=k0 + offs < K)


def _hidden_kernel(y_ptr, sx_ptr, sw_ptr, b_ptr, q_ptr, s_ptr, M, F, stride_ym, stride_qm,
                   inv_q, SRC_INT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
                   DKIND: tl.constexpr, FP8: tl.constexpr, RECIP: tl.constexpr, BLOCK: tl.constexpr,
                   STAGES: tl.constexpr):
    # one row of the hidden: columns [0, F) of y are the gate (or the up projection, ungated), [F, 2F) the up
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    q_row = q_ptr + row.to(tl.int64) * stride_qm
    if row >= M:
        for k0 in range(0, F, BLOCK):
            tl.store(q_row + k0 + offs, tl.full([BLOCK], 0, q_ptr.dtype.element_ty), mask=k0 + offs < F)
        tl.store(s_ptr + row, 1.0)
    else:
        y_row = y_ptr + row.to(tl.int64) * stride_ym
        sx = 1.0
        if SRC_INT:
            sx = tl.load(sx_ptr + row)
        amax = tl.full([BLOCK], 0.0, tl.float32)
        scale = 1.0
        for ps in tl.static_range(2):  # pass 0: the row's absmax; pass 1: recompute h and store its codes
            if ps == 1:
                m = tl.reduce(amax, 0, tl.standard._elementwise_max)
                scale = _row_scale(m, inv_q, FP8, RECIP)
                tl.store(s_ptr + row, scale)
            for k0 in tl.range(0, F, BLOCK, num_stages=STAGES):  # STAGES > 1: loads pipelined (cp.async)
                cols = k0 + offs
                ok = cols < F
                h = round_to(act(_epilogue(y_row, sx, sw_ptr, b_ptr, cols, ok, SRC_INT, HAS_BIAS, DKIND), ACT),
                              DKIND)
                if GATED:
                    u = _epilogue(y_row + F, sx, sw_ptr + F, b_ptr + F, cols, ok, SRC_INT, HAS_BIAS, DKIND)
                    h = round_to(h * u, DKIND)
                if ps == 0:
                    amax = tl.maximum(amax, tl.where(ok, tl.abs(h), 0.0))  # act(0) need not be 0 (sigmoid)
                else:
                    tl.store(q_row + cols, _encode(tl.math.div_rn(h, scale), FP8), mask=ok)


def _rescale_kernel(acc_ptr, sx_ptr, sw_ptr, b_ptr, o_ptr, M, N, stride_am, stride_om, HAS_BIAS: tl.constexpr,
                    DKIND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    ok = m_ok[:, None] & n_ok[None, :]
    acc = tl.load(acc_ptr + rm.to(tl.int64)[:, None] * stride_am + rn[None, :], mask=ok, other=0).to(tl.float32)
    sx = tl.load(sx_ptr + rm, mask=m_ok, other=0.0)
    sw = tl.load(sw_ptr + rn, mask=n_ok, other=0.0)
    y = round_to((acc * sx[:, None]) * sw[None, :], DKIND)
    if HAS_BIAS:
        b = round_to(tl.load(b_ptr + rn, mask=n_ok, other=0.0), DKIND)
        y = round_to(y + b[None, :], DKIND)
    tl.store(o_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], y.to(o_ptr.dtype.element_ty), mask=ok)


# --- torch references: the unfused path's own operations ---------------------------------


def quantize_rows_reference(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float32 scales [M, 1]) from `primitives.int8_symmetric_rows` / `fp8_rowwise`."""
    if kind == "int8":
        q, s = int8_symmetric_rows(x)
        return q, s.unsqueeze(-1)
    if kind == "fp8":
        return fp8_rowwise(x)
    raise unknown_choice("activation quantization kind", kind, KINDS)


def _projection_reference(y, row_scale, col_scale, bias, dtype):
    if y.dtype == torch.int32:  # Int8DynamicLinear: float rescale, then the activation dtype
        v = (y.float() * row_scale.reshape(-1, 1) * col_scale.reshape(1, -1)).to(dtype)
    else:  # Fp8RowwiseLinear: the GEMM's bf16 output cast to the activation dtype
        v = y.to(dtype)
    return v if bias is None else v + bias.to(dtype)


def hidden_reference(y, act="silu", *, gated=True, row_scale=None, col_scale=None, bias=None, rows=None,
                     dtype=torch.float32) -> torch.Tensor:
    """The FFN hidden act(g) * u (or act(u)) from the first GEMM's output, as the unfused torch FFN computes it."""
    rows = y.shape[0] if rows is None else rows
    f = y.shape[1] // 2 if gated else y.shape[1]
    y = y[:rows]
    rs = None if row_scale is None else row_scale.reshape(-1)[:rows]
    cols = (slice(0, f), slice(f, 2 * f))[: 1 + bool(gated)]
    part = [_projection_reference(y[:, c], rs, None if col_scale is None else col_scale.reshape(-1)[c],
                                  None if bias is None else bias[c], dtype) for c in cols]
    h = torch_act(act)(part[0])
    return h * part[1] if gated else h


def act_mul_quantize_reference(y, kind, act="silu", *, gated=True, row_scale=None, col_scale=None, bias=None,
                               rows=None, dtype=torch.float32):
    """What `act_mul_quantize` computes, as the unfused torch FFN computes it (no padding rows)."""
    h = hidden_reference(y, act, gated=gated, row_scale=row_scale, col_scale=col_scale, bias=bias, rows=rows,
                         dtype=dtype)
    return quantize_rows_reference(h, kind)


def rescale_int8_reference(acc, row_scale, col_scale, bias=None, *, rows=None, dtype=torch.float32):
    """Int8DynamicLinear's rescale and bias add: (acc * s_row * s_col).to(dtype) + bias."""
    rows = acc.shape[0] if rows is None else rows
    return _projection_reference(acc[:rows], row_scale.reshape(-1)[:rows], col_scale, bias, dtype)


# --- launching ----------------------------------------------------------------------------


def _check_kind(kind) -> bool:
    if kind not in KINDS:
        raise unknown_choice("activation quantization kind", kind, KINDS)
    return kind == "fp8"


def _check_device(t: torch.Tensor, what: str) -> None:
    if t.device.type == "cpu" and not interpreting():
        raise FFNQuantError(f"{what} runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1")
    if t.device.type not in ("cpu", "cuda"):
        raise FFNQuantError(f"{what} runs on cuda or cpu (interpreter) tensors, not {t.device.type}")


def _check_vector(t, n: int, name: str, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() != n or t.dtype != torch.float32:
        raise FFNQuantError(f"{name} must be a float32 tensor of {n} values, got {describe(t)}")
    if t.device != device:
        raise FFNQuantError(f"{name} is on {t.device} but the input is on {device}; move one of them")
    return t.reshape(-1).contiguous()


def _padded_rows(m: int, pad_to: int, min_rows: int) -> int:
    if not isinstance(pad_to, int) or pad_to < 1 or not isinstance(min_rows, int) or min_rows < 0:
        raise FFNQuantError(f"pad_to must be an int >= 1 and min_rows an int >= 0, got {pad_to!r} and {min_rows!r}")
    return max(-(-m // pad_to) * pad_to, min_rows)


def _codes(rows: int, cols: int, fp8: bool, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes as returned, the same memory as the kernel writes it, scales)."""
    if fp8:  # e4m3fn bit patterns are written as uint8
        raw = torch.empty((rows, cols), dtype=torch.uint8, device=device)
        codes = raw.view(torch.float8_e4m3fn)
    else:
        raw = codes = torch.empty((rows, cols), dtype=torch.int8, device=device)
    return codes, raw, torch.empty((rows, 1), dtype=torch.float32, device=device)


def _block(n: int, programs: int, interpret: bool, decode_block: int = 2048) -> tuple[int, int, int]:
    """(elements per loop step, warps, pipeline stages) for rows of n; small steps in the interpreter, so tests
    take the loop. Fewer programs than SMs (decode): longer steps (up to `decode_block`) and pipelined loads
    (several steps in flight), as occupancy cannot hide their latency; otherwise many programs per SM do.
    (Heuristics, not yet tuned on a device.)"""
    p2 = 1 << max(0, (n - 1).bit_length())
    if interpret:
        return min(p2, 64), 1, 1
    if programs < 128:
        block = max(min(p2, decode_block), 128)
        return block, max(1, min(16, block // 256)), 3
    block = max(min(p2, 2048), 128)
    return block, max(1, min(8, block // 256)), 1


# Unchecked launchers: the public functions below validate, the fused modules call these with their own buffers.


def _inv_q(fp8: bool) -> float:
    """The reciprocal torch's CUDA division by the scalar 448 or 127 multiplies with: 1/q in double, rounded to
    float32 (a Python float holding exactly that float32 value)."""
    return float(torch.tensor(1.0 / (448.0 if fp8 else 127.0), dtype=torch.float64).float())


def _launch_rows(x, fp8: bool, rows: int):
    m, k = x.shape
    codes, raw, scales = _codes(rows, k, fp8, x.device)
    if rows:
        interpret = interpreting()
        if x.stride(1) != 1:
            x = x.contiguous()
        # a decode row of up to 4096 is one step (the second pass then re-reads it from L2)
        block, warps, _ = _block(k, rows, interpret, decode_block=4096)
        _kernels(interpret).rows[(rows,)](x, raw, scales, m, k, x.stride(0), raw.stride(0), _inv_q(fp8), FP8=fp8,
                                          RECIP=x.is_cuda, BLOCK=block, num_warps=warps, enable_fp_fusion=False)
    return codes, scales


def _launch_hidden(y, fp8: bool, act: str, gated: bool, row_scale, col_scale, bias, rows: int, dtype, out_rows: int):
    f = y.shape[1] // 2 if gated else y.shape[1]
    codes, raw, scales = _codes(out_rows, f, fp8, y.device)
    if out_rows and f:
        interpret = interpreting()
        if y.stride(1) != 1:
            y = y.contiguous()
        src_int = y.dtype == torch.int32
        block, warps, stages = _block(f, out_rows, interpret)
        dummy = scales  # never read: a pointer for the absent scales and bias
        _kernels(interpret).hidden[(out_rows,)](
            y, row_scale if src_int else dummy, col_scale if src_int else dummy, dummy if bias is None else bias,
            raw, scales, rows, f, y.stride(0), raw.stride(0), _inv_q(fp8), SRC_INT=src_int,
            HAS_BIAS=bias is not None, GATED=bool(gated), ACT=_ACT_CODE[act], DKIND=_DKIND[dtype], FP8=fp8,
            RECIP=y.is_cuda, BLOCK=block, STAGES=stages, num_warps=warps, enable_fp_fusion=False)
    return codes, scales


def _launch_rescale(acc, row_scale, col_scale, bias, rows: int, dtype):
    n = acc.shape[1]
    out = torch.empty((rows, n), dtype=dtype, device=acc.device)
    if rows and n:
        interpret = interpreting()
        if acc.stride(1) != 1:
            acc = acc.contiguous()
        bm, bn = min(16, 1 << (rows - 1).bit_length()), (32 if interpret else 256)
        grid = (-(-n // bn), -(-rows // bm))
        _kernels(interpret).rescale[grid](acc, row_scale, col_scale, col_scale if bias is None else bias, out, rows, n,
                                          acc.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                                          DKIND=_DKIND[dtype], BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
                                          enable_fp_fusion=False)
    return out


def quantize_rows(x: torch.Tensor, kind: str, *, pad_to: int = 1, min_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (per-token) quantization in one launch: (codes [R, K], float32 scales [R, 1]).

    kind "int8": codes int8, as `int8_symmetric_rows`; "fp8": codes float8_e4m3fn, as `fp8_rowwise`. R is M
    rounded up to a multiple of `pad_to`, at least `min_rows`; rows past M have code 0 and scale 1.0 (the fp8
    GEMM wants multiples of 16 rows, cuBLAS int8 more than 16).
    """
    fp8 = _check_kind(kind)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _DKIND:
        raise FFNQuantError(f"quantize_rows needs x as a 2-D float16, bfloat16 or float32 [M, K] tensor, got {describe(x)}")
    if x.shape[1] == 0:
        raise FFNQuantError("quantize_rows needs at least one feature per row (x has K = 0)")
    rows = _padded_rows(x.shape[0], pad_to, min_rows)
    _check_device(x, "quantize_rows")
    return _launch_rows(x, fp8, rows)


def act_mul_quantize(y: torch.Tensor, kind: str, act: str = "silu", *, gated: bool = True,
                     row_scale: torch.Tensor | None = None, col_scale: torch.Tensor | None = None,
                     bias: torch.Tensor | None = None, rows: int | None = None, dtype: torch.dtype = torch.float32,
                     pad_to: int = 1, min_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The FFN hidden act(g) * u (gated) or act(u), quantized per row, in one launch: (codes [R, F], scales [R, 1]).

    y: the first GEMM's output, [>= rows, 2F] gated (gate columns first) or [>= rows, F]: int32 accumulators of
    `torch._int_mm` with float32 `row_scale` (one per row of y) and `col_scale` (one per column), or the float
    output of `torch._scaled_mm` (no scales). bias: float32, one per column of y, or None. rows: the valid rows
    (default all); R as in `quantize_rows`. dtype: where the unfused torch path rounds each intermediate (the
    activation dtype); float32 keeps h in float32 throughout.
    """
    fp8 = _check_kind(kind)
    if act not in _ACT_CODE:
        raise unknown_choice("activation", act, ACTIVATIONS)
    if dtype not in _DKIND:
        raise unknown_choice("dtype", dtype, tuple(_DKIND))
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or y.dtype not in (torch.int32, *_DKIND):
        raise FFNQuantError(f"act_mul_quantize needs y as a 2-D int32, float16, bfloat16 or float32 tensor, "
                            f"got {describe(y)}")
    n = y.shape[1]
    if gated and n % 2:
        raise FFNQuantError(f"a gated hidden needs y with gate and up columns (an even count), got {n}")
    rows = y.shape[0] if rows is None else rows
    if not isinstance(rows, int) or not 0 <= rows <= y.shape[0]:
        raise FFNQuantError(f"rows must be an int in 0..{y.shape[0]} (the rows of y), got {rows!r}")
    src_int = y.dtype == torch.int32
    if src_int != (row_scale is not None and col_scale is not None):
        raise FFNQuantError("int32 accumulators need row_scale and col_scale; a float GEMM output takes neither")
    _check_device(y, "act_mul_quantize")
    if src_int:
        row_scale = _check_vector(row_scale, y.shape[0], "row_scale", y.device)
        col_scale = _check_vector(col_scale, n, "col_scale", y.device)
    if bias is not None:
        bias = _check_vector(bias, n, "bias", y.device)
    return _launch_hidden(y, fp8, act, gated, row_scale, col_scale, bias, rows, dtype,
                          _padded_rows(rows, pad_to, min_rows))


def rescale_int8(acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 *, rows: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(acc * row_scale * col_scale).to(dtype) + bias in one launch, for the first `rows` rows of int32 acc [R, N]."""
    if dtype not in _DKIND:
        raise unknown_choice("dtype", dtype, tuple(_DKIND))
    if not isinstance(acc, torch.Tensor) or acc.dim() != 2 or acc.dtype != torch.int32:
        raise FFNQuantError(f"rescale_int8 needs acc as a 2-D int32 tensor, got {describe(acc)}")
    rows = acc.shape[0] if rows is None else rows
    if not isinstance(rows, int) or not 0 <= rows <= acc.shape[0]:
        raise FFNQuantError(f"rows must be an int in 0..{acc.shape[0]} (the rows of acc), got {rows!r}")
    _check_device(acc, "rescale_int8")
    n = acc.shape[1]
    row_scale = _check_vector(row_scale, acc.shape[0], "row_scale", acc.device)
    col_scale = _check_vector(col_scale, n, "col_scale", acc.device)
    if bias is not None:
        bias = _check_vector(bias, n, "bias", acc.device)
    return _launch_rescale(acc, row_scale, col_scale, bias, rows, dtype)
