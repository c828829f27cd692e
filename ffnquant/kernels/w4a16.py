"""Triton W4A16: int4 weights dequantized inside the matmul, in ffnquant's symmetric group numerics.

The numerics are exactly those of `ffnquant.numerics.primitives.int4_group_rtn(w, g, symmetric=True)`:
codes q in 0..15 with zero point 8, one scale per `group_size` consecutive input features, and
w = (q - 8) * scale with the scale as stored (float16 by default: the stored scale is the
numerics of record). The kernels never round a dequantized weight to the activation dtype:
(q - 8) is an integer in -8..7, exact in every float type, so products with x are formed
from the integer code and the group scale is applied to the float32 partial sum of each
group. The only differences from `w4a16_reference` are float32 summation order and the
final rounding to x's dtype.

Two kernels, chosen per call by a small measured tuner (cached per shape and dtype):
- `gemv` (M = 1, and any M when the group's power-of-two part is < 32): one program per
  (BLOCK_N columns, row of x, K split). Codes are read as int32 words (8 codes each) and
  turned into floats with the 2**23 exponent trick (an OR and a subtract, no int->float
  conversion), the power-of-16 factor of each nibble folded into x; a K step covers
  BLOCK_K // group groups, so the scale multiply is one FMA per word; the next step's codes
  are prefetched by hand while the current one is computed.
- `dot` (M >= 2): BLOCK_M x BLOCK_N tiles, one group (or its power-of-two part, <= 128) per
  K step: the codes as (q - 8) in x's dtype and a contiguous x tile feed `tl.dot` (fp32
  accumulation; Triton pipelines both loads), then the partial sum is scaled per column.
Both can split K (SPLIT_K > 1): partials are added atomically into a zeroed float32 buffer,
then cast (two more small launches; run-to-run bit differences in the float32 sums).
The tuner times each candidate as a CUDA-graph replay with a cold L2 (eager timing would
measure Python launch overhead). Under TRITON_INTERPRET=1 (CPU tensors) a fixed small
config is used and nothing is timed.

Measured on an H200 (triton 3.6, fp16, d_model 4096 / d_ff 11008, group 128, cold L2):
M = 1 ~24 us per projection (~1.5x fp16 cuBLAS; ~1 TB/s, far from the HBM roofline: the
kernels are latency- and issue-bound, not bandwidth-bound); M = 16 about cuBLAS's time;
M >= 512 about 3.5x slower than cuBLAS (the dequantization is redone per M tile).

Triton is imported lazily and the kernels are compiled (or interpreted) on first use, so
TRITON_INTERPRET may be set at any time before the first launch in each mode.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from ..errors import FFNQuantError, unknown_choice
from .tritonenv import fastest, import_triton, interpreting
from .w4a16_pack import (ACTIVATIONS, SCALE_DTYPES, KeptDtypes, PackedW4, dequantize_w4, describe, pack_w4, torch_act,
                         w4a16_gated_reference, w4a16_reference)

__all__ = [
    "ACTIVATIONS",
    "KernelConfig",
    "PackedW4",
    "W4A16Linear",
    "dequantize_w4",
    "pack_w4",
    "triton_status",
    "w4a16_config_used",
    "w4a16_gated",
    "w4a16_gated_reference",
    "w4a16_matmul",
    "w4a16_reference",
]

_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}
_X_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# set by _triton(); the kernel bodies below resolve `tl` from this module's globals
triton = None
tl = None


# --- environment --------------------------------------------------------------------------




def triton_status() -> tuple[bool, str]:
    """(can the Triton kernel run here, why or why not)."""
    try:
        import triton as _t
    except Exception as exc:  # not installed, or broken (missing libs)
        return False, f"triton is not installed or fails to import: {type(exc).__name__}: {exc}"
    if interpreting():
        return True, f"triton {_t.__version__} interpreter (TRITON_INTERPRET=1): CPU tensors, slow"
    if torch.cuda.is_available():
        return True, f"triton {_t.__version__} on CUDA ({torch.cuda.get_device_name(0)})"
    return False, (f"no CUDA device (torch {torch.__version__}) and TRITON_INTERPRET is not 1 "
                   "(set TRITON_INTERPRET=1 to run on CPU tensors in Triton's interpreter)")


def _triton():
    """Import triton into this module's globals (the kernel bodies resolve `tl` there)."""
    global triton, tl
    if tl is None:
        triton, tl = import_triton("the W4A16 kernel")
    return triton


_KERNELS: dict[bool, SimpleNamespace] = {}


def _kernels(interpret: bool) -> SimpleNamespace:
    # Decorated per mode on first use: triton.jit picks compiled vs interpreted at decoration time,
    # so decorating at import would freeze whatever TRITON_INTERPRET was when this module loaded.
    if interpret not in _KERNELS:
        t = _triton()
        _KERNELS[interpret] = SimpleNamespace(gemv=t.jit(_gemv_kernel), dot=t.jit(_dot_kernel))
    return _KERNELS[interpret]


# --- kernels ------------------------------------------------------------------------------
# The magic constant 0x4B000000 is 2**23 as float32: OR-ing an integer c < 2**23 into its
# mantissa gives the float 2**23 + c exactly, so (bits | magic) - (2**23 + 8 * 16**j) is
# 16**j * (q - 8) for the nibble q at bit 4j, with no int->float conversion. The 16**j is
# folded into x (exact: a power of two).


def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, w2_ptr, s2_ptr, o_ptr,
    N, KW, NGRP, stride_xm, stride_om, iters_per_split, total_iters,
    GROUP: tl.constexpr, SUB: tl.constexpr, NG: tl.constexpr, SW: tl.constexpr, XKIND: tl.constexpr,
    BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
):
    # One row m of x against BLOCK_N weight rows; a K step is NG sub-blocks of SUB codes (SW words each),
    # each inside one group, so the tile is [BLOCK_N, NG, SW] words, contiguous along (NG, SW).
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rg = tl.arange(0, NG)
    step = rg[:, None] * SW + tl.arange(0, SW)[None, :]  # word offsets inside one K step
    w_rows = rn.to(tl.int64)[:, None, None] * KW
    s_rows = rn[:, None] * NGRP
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.full([BLOCK_N, NG, SW], 0.0, tl.float32)
    acc2 = tl.full([BLOCK_N, NG, SW], 0.0, tl.float32)
    it0 = pid_k * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, total_iters)
    # software prefetch: the next step's codes and scales are loaded before this step's math, so a program
    # always has a weight tile in flight (the loop has no tl.dot, so Triton's pipeliner does not do this)
    kw_end = tl.minimum(it1 * (NG * SW), KW)
    wo = it0 * (NG * SW) + step
    sidx = (it0 * (NG * SUB) + rg * SUB) // GROUP
    w_nx = tl.load(w_ptr + w_rows + wo[None, :, :], mask=n_ok[:, None, None] & (wo < kw_end)[None, :, :], other=0)
    s_nx = tl.load(s_ptr + s_rows + sidx[None, :], mask=n_ok[:, None] & (sidx < NGRP)[None, :], other=0.0)
    w2_nx = w_nx
    s2_nx = s_nx
    if GATED:
        w2_nx = tl.load(w2_ptr + w_rows + wo[None, :, :], mask=n_ok[:, None, None] & (wo < kw_end)[None, :, :],
                        other=0)
        s2_nx = tl.load(s2_ptr + s_rows + sidx[None, :], mask=n_ok[:, None] & (sidx < NGRP)[None, :], other=0.0)
    for it in range(it0, it1):
        w = w_nx
        s = s_nx.to(tl.float32)
        w2 = w2_nx
        s2 = s2_nx.to(tl.float32)
        wo = it * (NG * SW) + step  # [NG, SW] word index along K
        k_ok = wo < KW
        wo_n = wo + NG * SW
        sidx_n = ((it + 1) * (NG * SUB) + rg * SUB) // GROUP  # group of each sub-block, next step
        wmask_n = n_ok[:, None, None] & (wo_n < kw_end)[None, :, :]
        smask_n = n_ok[:, None] & (sidx_n < NGRP)[None, :]
        w_nx = tl.load(w_ptr + w_rows + wo_n[None, :, :], mask=wmask_n, other=0)
        s_nx = tl.load(s_ptr + s_rows + sidx_n[None, :], mask=smask_n, other=0.0)
        if GATED:
            w2_nx = tl.load(w2_ptr + w_rows + wo_n[None, :, :], mask=wmask_n, other=0)
            s2_nx = tl.load(s2_ptr + s_rows + sidx_n[None, :], mask=smask_n, other=0.0)
        ke = wo * 8  # first code (x column) of each word
        x0 = tl.load(x_row + ke, mask=k_ok, other=0.0).to(tl.float32)[None, :, :]
        x1 = (tl.load(x_row + ke + 1, mask=k_ok, other=0.0).to(tl.float32) * 0.0625)[None, :, :]
        x2 = (tl.load(x_row + ke + 2, mask=k_ok, other=0.0).to(tl.float32) * 0.00390625)[None, :, :]
        x3 = (tl.load(x_row + ke + 3, mask=k_ok, other=0.0).to(tl.float32) * 0.000244140625)[None, :, :]
        x4 = tl.load(x_row + ke + 4, mask=k_ok, other=0.0).to(tl.float32)[None, :, :]
        x5 = (tl.load(x_row + ke + 5, mask=k_ok, other=0.0).to(tl.float32) * 0.0625)[None, :, :]
        x6 = (tl.load(x_row + ke + 6, mask=k_ok, other=0.0).to(tl.float32) * 0.00390625)[None, :, :]
        x7 = (tl.load(x_row + ke + 7, mask=k_ok, other=0.0).to(tl.float32) * 0.000244140625)[None, :, :]
        wh = w >> 16
        t = (((w & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * x0
        t += (((w & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x1
        t += (((w & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - 8390656.0) * x2
        t += (((w & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - 8421376.0) * x3
        t += (((wh & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * x4
        t += (((wh & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x5
        t += (((wh & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - 8390656.0) * x6
        t += (((wh & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - 8421376.0) * x7
        acc += t * s[:, :, None]
        if GATED:
            w = w2
            s = s2
            wh = w >> 16
            t = (((w & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * x0
            t += (((w & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x1
            t += (((w & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - 8390656.0) * x2
            t += (((w & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - 8421376.0) * x3
            t += (((wh & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * x4
            t += (((wh & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x5
            t += (((wh & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - 8390656.0) * x6
            t += (((wh & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - 8421376.0) * x7
            acc2 += t * s[:, :, None]
    # tl.reduce with the standard sum combiner, not tl.sum (likewise tl.full, not tl.zeros; exp, not tl.sigmoid):
    # those are @jit functions decorated when triton was imported, which the interpreter can call only if
    # TRITON_INTERPRET was set by then; builtins work in both modes whenever the variable is set.
    res = tl.reduce(tl.reduce(acc, 2, tl.standard._sum_combine), 1, tl.standard._sum_combine)
    if GATED:
        up = tl.reduce(tl.reduce(acc2, 2, tl.standard._sum_combine), 1, tl.standard._sum_combine)
        # activations as torch defines them; 1 + tanh(u) == 2 * sigmoid(2u) gives gelu_tanh without tanh
        if ACT == 0:
            res = res / (1.0 + tl.exp(-res))
        elif ACT == 1:
            res = 0.5 * res * (1.0 + tl.erf(res * 0.7071067811865476))
        elif ACT == 2:
            res = res / (1.0 + tl.exp(-1.5957691216057308 * (res + 0.044715 * res * res * res)))
        elif ACT == 3:
            res = tl.maximum(res, 0.0)
        elif ACT == 4:
            res = 1.0 / (1.0 + tl.exp(-res))
        res = res * up
    out = o_ptr + m.to(tl.int64) * stride_om + rn
    if ATOMIC:
        tl.atomic_add(out, res, mask=n_ok)
    else:
        if XKIND == 2:
            # round to nearest even on the float32 bits, so the cast to bf16 is exact in any rounding mode (Triton's
            # interpreter truncates float32 -> bf16); NaN passes through unchanged
            bits = res.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            res = tl.where(res == res, bits.to(tl.float32, bitcast=True), res)
        tl.store(out, res.to(o_ptr.dtype.element_ty), mask=n_ok)


def _dot_kernel(
    x_ptr, b_ptr, s_ptr, b2_ptr, s2_ptr, o_ptr,
    M, N, KB, NGRP, stride_xm, stride_om, iters_per_split, total_iters,
    GROUP: tl.constexpr, SUB: tl.constexpr, XKIND: tl.constexpr, DOT_DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
):
    # [BLOCK_M, BLOCK_N] output tile; one K step = SUB codes inside one group: a contiguous [BLOCK_M, SUB] x tile
    # and the [SUB / 2, BLOCK_N] code bytes, both plain tile loads that Triton software-pipelines (cp.async,
    # num_stages). The codes are put back in k order (low nibble = even k) so one tl.dot covers the step, and the
    # float32 partial is scaled per output column. Also the decode path for M = 1 (BLOCK_M 16: the padded rows
    # cost no memory traffic, and the tensor cores do the multiply-adds).
    SH: tl.constexpr = SUB // 2
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rj = tl.arange(0, SH)
    rk = tl.arange(0, SUB)
    b_cols = rn.to(tl.int64)[None, :] * KB
    s_cols = rn * NGRP
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    acc2 = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    it0 = pid_k * iters_per_split
    it1 = tl.minimum(it0 + iters_per_split, total_iters)
    # the scales are too small for cp.async pipelining: prefetch them two steps ahead by hand (indices clamped
    # to the last step rather than masked: a redundant load is harmless)
    last = total_iters - 1
    s_a = tl.load(s_ptr + s_cols + (tl.minimum(it0, last) * SUB) // GROUP, mask=n_ok, other=0.0)
    s_b = tl.load(s_ptr + s_cols + (tl.minimum(it0 + 1, last) * SUB) // GROUP, mask=n_ok, other=0.0)
    s2_a = s_a
    s2_b = s_b
    if GATED:
        s2_a = tl.load(s2_ptr + s_cols + (tl.minimum(it0, last) * SUB) // GROUP, mask=n_ok, other=0.0)
        s2_b = tl.load(s2_ptr + s_cols + (tl.minimum(it0 + 1, last) * SUB) // GROUP, mask=n_ok, other=0.0)
    for it in range(it0, it1):
        s = s_a.to(tl.float32)
        s_a = s_b
        s_b = tl.load(s_ptr + s_cols + (tl.minimum(it + 2, last) * SUB) // GROUP, mask=n_ok, other=0.0)
        x = tl.load(x_rows + (it * SUB + rk)[None, :], mask=m_ok[:, None], other=0.0).to(DOT_DT)
        b = tl.load(b_ptr + b_cols + (it * SH + rj)[:, None], mask=n_ok[None, :], other=0)  # [SH, BLOCK_N] uint8
        # (q - 8) exactly, via the exponent trick: 1024 + q in fp16, else 2**23 + q in fp32 (then an exact cast
        # to bf16; bf16 arithmetic on bitcast values is wrong in the interpreter, so it is not used)
        if XKIND == 1:
            lo = ((b & 15).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
            hi = ((b >> 4).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        else:
            lo = ((b & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            hi = ((b >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        w = tl.reshape(tl.permute(tl.join(lo.to(DOT_DT), hi.to(DOT_DT)), (0, 2, 1)), (SUB, BLOCK_N))
        acc += tl.dot(x, w, input_precision="ieee") * s[None, :]
        if GATED:
            s = s2_a.to(tl.float32)
            s2_a = s2_b
            s2_b = tl.load(s2_ptr + s_cols + (tl.minimum(it + 2, last) * SUB) // GROUP, mask=n_ok, other=0.0)
            b = tl.load(b2_ptr + b_cols + (it * SH + rj)[:, None], mask=n_ok[None, :], other=0)
            if XKIND == 1:
                lo = ((b & 15).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
                hi = ((b >> 4).to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
            else:
                lo = ((b & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
                hi = ((b >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            w = tl.reshape(tl.permute(tl.join(lo.to(DOT_DT), hi.to(DOT_DT)), (0, 2, 1)), (SUB, BLOCK_N))
            acc2 += tl.dot(x, w, input_precision="ieee") * s[None, :]
    res = acc
    if GATED:
        # the same epilogue as _gemv_kernel's: a shared @jit helper would be bound to one of the two
        # modes (compiled or interpreted) at decoration, see _kernels()
        if ACT == 0:
            res = res / (1.0 + tl.exp(-res))
        elif ACT == 1:
            res = 0.5 * res * (1.0 + tl.erf(res * 0.7071067811865476))
        elif ACT == 2:
            res = res / (1.0 + tl.exp(-1.5957691216057308 * (res + 0.044715 * res * res * res)))
        elif ACT == 3:
            res = tl.maximum(res, 0.0)
        elif ACT == 4:
            res = 1.0 / (1.0 + tl.exp(-res))
        res = res * acc2
    out = o_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    omask = m_ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(out, res, mask=omask)
    else:
        if XKIND == 2:
            # round to nearest even on the float32 bits, so the cast to bf16 is exact in any rounding mode (Triton's
            # interpreter truncates float32 -> bf16); NaN passes through unchanged
            bits = res.to(tl.int32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
            res = tl.where(res == res, bits.to(tl.float32, bitcast=True), res)
        tl.store(out, res.to(o_ptr.dtype.element_ty), mask=omask)


# --- configs and tuning -------------------------------------------------------------------


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration. block_k: codes per K step (gemv) or per dot step (dot, <= the group's power-of-two part)."""

    path: str  # "gemv" or "dot"
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1


def _pow2_part(g: int) -> int:
    return g & -g


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


def _m_bucket(m: int) -> int:
    return min(_next_pow2(m), 256)


def _candidates(m: int, p: PackedW4, gated: bool) -> list[KernelConfig]:
    """The few configs the tuner times for this shape (the first one is used untimed during graph capture)."""
    pg = _pow2_part(p.group_size)
    kmax = _next_pow2(p.k)
    sub_dot = min(pg, 128)
    can_dot = sub_dot >= 32  # tl.dot needs depth >= 16 per nibble plane

    def gemv(bn, bk, sk, warps, stages):
        return KernelConfig("gemv", 1, bn, max(8, min(bk, kmax)), sk, warps, stages)

    def dot(bm, bn, sk, warps, stages):
        return KernelConfig("dot", bm, bn, sub_dot, sk, warps, stages)

    b = _m_bucket(m)
    # Measured on an H200 (triton 3.6, d_model 4096 / d_ff 11008, group 128, graph replay, cold L2): at M = 1 the
    # gemv kernel with 16 x 1024 tiles leads (~24 us for either projection), at M = 2..16 the dot kernel with a
    # K split of 2..4 (enough programs for 132 SMs). The other entries are the runners-up, kept because shapes
    # and group sizes move the optimum.
    gemv_fast = [gemv(16, 1024, 1, 4, 1), gemv(64, 128, 16, 4, 1), gemv(64, 256, 8, 4, 1), gemv(16, 1024, 2, 4, 1),
                 gemv(32, 256, 4, 4, 1), gemv(64, 256, 4, 4, 1)]
    dot_small = [dot(16, 32, 4, 4, 4), dot(16, 32, 2, 4, 4), dot(16, 16, 2, 2, 4), dot(16, 64, 4, 8, 3),
                 dot(16, 64, 4, 4, 3), dot(16, 32, 2, 2, 4), dot(16, 64, 2, 4, 4), dot(16, 128, 4, 8, 3)]
    if not can_dot:
        cands = gemv_fast if b <= 4 else gemv_fast[:2]
    elif b == 1:
        cands = gemv_fast + dot_small[1:3]
    elif b <= 4:
        cands = gemv_fast[:2] + dot_small[:5]
    elif b <= 16:
        cands = dot_small
    elif b <= 64:
        cands = [dot(32, 64, 1, 4, 4), dot(64, 64, 1, 4, 4), dot(32, 128, 1, 4, 3), dot(64, 128, 1, 8, 3),
                 dot(32, 64, 2, 4, 4), dot(16, 64, 2, 4, 4)]
    else:
        cands = [dot(64, 128, 1, 4, 3), dot(128, 128, 1, 8, 3), dot(128, 64, 1, 4, 4), dot(128, 128, 1, 8, 4)]
    if gated:  # the activation needs the whole sum: the same tiles without a K split
        cands = [replace(c, split_k=1) for c in cands]
    out: list[KernelConfig] = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def _interpreter_config(m: int, p: PackedW4) -> KernelConfig:
    # the interpreter runs each program in numpy: small tiles, nothing timed
    pg = _pow2_part(p.group_size)
    if m >= 2 and min(pg, 128) >= 32:
        return KernelConfig("dot", 16, 32, min(pg, 128))
    return KernelConfig("gemv", 1, 16, max(min(256, _next_pow2(p.k)), min(pg, 256)))


_TUNED: dict[tuple, KernelConfig] = {}


def _tune_key(x: torch.Tensor, p: PackedW4, gated: bool) -> tuple:
    return (str(x.device), x.dtype, _m_bucket(x.shape[0]), p.n, p.k, p.group_size, p.scales.dtype, gated)


def w4a16_config_used(x: torch.Tensor, p: PackedW4, gated: bool = False) -> KernelConfig | None:
    """The config a call with this input and weight uses now (None: not tuned yet on CUDA)."""
    if interpreting():
        return _interpreter_config(x.shape[0], p)
    return _TUNED.get(_tune_key(x, p, gated))


def _select(x: torch.Tensor, p: PackedW4, launch, gated: bool) -> KernelConfig:
    """The cached config for this shape, else time the candidates once with `launch(cfg)` and keep the fastest."""
    m = x.shape[0]
    if interpreting():
        return _interpreter_config(m, p)
    key = _tune_key(x, p, gated)
    if key in _TUNED:
        return _TUNED[key]
    cands = _candidates(m, p, gated)
    if torch.cuda.is_current_stream_capturing():
        return cands[0]  # no timing inside a graph capture; the next eager call tunes
    best = fastest(cands, launch, f"W4A16 kernel for M={m}, N={p.n}, K={p.k}")
    _TUNED[key] = best
    return best


# --- launching ----------------------------------------------------------------------------


def _check_call(x: torch.Tensor, p: PackedW4) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise FFNQuantError(f"w4a16 needs x as a 2-D float16, bfloat16 or float32 [M, K] tensor, got {describe(x)}")
    if x.shape[1] != p.k:
        raise FFNQuantError(f"x has {x.shape[1]} features but the weight takes {p.k}")
    if p.packed.dtype != torch.uint8 or tuple(p.packed.shape) != (p.n, p.k // 2):
        raise FFNQuantError(f"packed codes must be uint8 [{p.n}, {p.k // 2}], got {describe(p.packed)}")
    if tuple(p.scales.shape) != (p.n, p.k // p.group_size) or p.scales.dtype not in SCALE_DTYPES:
        raise FFNQuantError(f"scales must be float [{p.n}, {p.k // p.group_size}], got {describe(p.scales)}")
    if p.zero_points is not None:  # this kernel hard-codes zero point 8
        raise FFNQuantError("this W4A16 kernel takes symmetric groups only; run zero points on w4a16_tiled (repack_w4)")
    if p.packed.device != x.device or p.scales.device != x.device:
        raise FFNQuantError(f"x is on {x.device} but the weight is on {p.packed.device}; move one of them")
    if x.device.type == "cpu" and not interpreting():
        raise FFNQuantError("the Triton W4A16 kernel runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1")
    if x.device.type not in ("cpu", "cuda"):
        raise FFNQuantError(f"the Triton W4A16 kernel runs on cuda or cpu (interpreter) tensors, not {x.device.type}")


def _launch(cfg: KernelConfig, x: torch.Tensor, p: PackedW4, p2: PackedW4 | None = None, act: str = "identity",
            gated: bool = False) -> torch.Tensor:
    kern = _kernels(interpreting())
    m, k = x.shape
    n, g = p.n, p.group_size
    atomic = cfg.split_k > 1
    if atomic and gated:
        raise FFNQuantError("the gated kernel cannot split K (the activation needs the whole sum); use split_k=1")
    if atomic:  # partial sums meet in float32, then one cast
        out = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    q2 = p2 if p2 is not None else p
    common = dict(ATOMIC=atomic, GATED=gated, ACT=_ACT_CODE[act], num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.path == "gemv":
        sub = min(_pow2_part(g), cfg.block_k)
        if cfg.block_k % sub or sub % 8:
            raise FFNQuantError(f"gemv block_k {cfg.block_k} must be a multiple of 8 and of min(group part, block_k)")
        if m > 65535:  # rows of x are grid axis 1
            raise FFNQuantError(f"the gemv kernel takes at most 65535 rows of x, got {m}; split the batch")
        words = cfg.block_k // 8
        total = -(-(k // 8) // words)
        per = -(-total // cfg.split_k)
        grid = (-(-n // cfg.block_n), m, -(-total // per))
        kern.gemv[grid](
            x, p.packed.view(torch.int32), p.scales, q2.packed.view(torch.int32), q2.scales, out,
            n, k // 8, k // g, x.stride(0), out.stride(0), per, total,
            GROUP=g, SUB=sub, NG=cfg.block_k // sub, SW=sub // 8, XKIND=_X_DTYPES[x.dtype], BLOCK_N=cfg.block_n,
            **common,
        )
    elif cfg.path == "dot":
        sub = cfg.block_k
        if g % sub or sub < 32 or sub & (sub - 1):
            raise FFNQuantError(f"dot block_k {sub} must be a power of two >= 32 dividing group_size {g}")
        total = k // sub
        per = -(-total // cfg.split_k)
        grid = (-(-n // cfg.block_n), -(-m // cfg.block_m), -(-total // per))
        kern.dot[grid](
            x, p.packed, p.scales, q2.packed, q2.scales, out,
            m, n, k // 2, k // g, x.stride(0), out.stride(0), per, total,
            GROUP=g, SUB=sub, XKIND=_X_DTYPES[x.dtype], DOT_DT=_dot_dtype(x.dtype), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, **common,
        )
    else:
        raise unknown_choice("kernel path", cfg.path, ("gemv", "dot"))
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _dot_dtype(dt: torch.dtype):
    # the dot's operand dtype: x's own, except bf16 under the interpreter, whose bf16 tl.dot returns garbage
    # (triton 3.9); float32 operands give the same products there (bf16 x small integer is exact in float32)
    if dt == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dt]


def _prepare(x: torch.Tensor, p: PackedW4) -> torch.Tensor:
    _check_call(x, p)
    _triton()
    if x.stride(1) != 1:
        x = x.contiguous()
    return x


def w4a16_matmul(x: torch.Tensor, p: PackedW4, config: KernelConfig | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x.dtype (float16, bfloat16 or float32), float32 accumulation, on the Triton kernel.

    `config` forces a launch config (tests, benchmarks); by default one is measured per shape and cached.
    """
    x = _prepare(x, p)
    if x.shape[0] == 0 or p.n == 0:
        return torch.zeros((x.shape[0], p.n), dtype=x.dtype, device=x.device)

    def launch(cfg: KernelConfig) -> torch.Tensor:
        return _launch(cfg, x, p)

    return launch(config or _select(x, p, launch, gated=False))


def w4a16_gated(x: torch.Tensor, p_gate: PackedW4, p_up: PackedW4, act: str = "silu",
                config: KernelConfig | None = None) -> torch.Tensor:
    """act(x @ Wg^T) * (x @ Wu^T) in one launch (both weights read by the same program), x.dtype out."""
    torch_act(act)  # validates the name
    if (p_gate.n, p_gate.k, p_gate.group_size, p_gate.scales.dtype) != (p_up.n, p_up.k, p_up.group_size,
                                                                         p_up.scales.dtype):
        raise FFNQuantError("gate and up weights must share shape, group size and scale dtype")
    x = _prepare(x, p_gate)
    _check_call(x, p_up)
    if x.shape[0] == 0 or p_gate.n == 0:
        return torch.zeros((x.shape[0], p_gate.n), dtype=x.dtype, device=x.device)
    if config is not None and config.split_k != 1:
        raise FFNQuantError("the gated kernel cannot split K (the activation needs the whole sum); use split_k=1")

    def launch(cfg: KernelConfig) -> torch.Tensor:
        return _launch(cfg, x, p_gate, p_up, act, gated=True)

    return launch(config or _select(x, p_gate, launch, gated=True))


# --- module -------------------------------------------------------------------------------


class W4A16Linear(KeptDtypes):
    """nn.Linear replacement with int4 weights (ffnquant's symmetric groups) run by the Triton W4A16 kernel.

    Buffers: `packed` (uint8 [out, in/2]), `scales` ([out, in/g], float16 by default) and `bias`
    (or None). The scales keep their dtype through `module.to(dtype)` / `.half()`: they are the
    numerics of record, and a cast to bf16 would change every weight.
    """

    kept_dtypes = ("scales",)

    def __init__(self, linear: torch.nn.Linear, group_size: int, device=None,
                 scale_dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        if not isinstance(linear, torch.nn.Linear):
            raise FFNQuantError(f"W4A16Linear wraps a torch.nn.Linear, got {type(linear).__name__}")
        p = pack_w4(linear.weight.detach().float().cpu(), group_size, scale_dtype)
        self.in_features, self.out_features, self.group_size = p.k, p.n, group_size
        dev = torch.device(device) if device is not None else linear.weight.device
        self.register_buffer("packed", p.packed.to(dev))
        self.register_buffer("scales", p.scales.to(dev))
        bias = linear.bias.detach().clone().to(dev) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    @property
    def weight_packed(self) -> PackedW4:
        """The buffers as a PackedW4 (views, no copy)."""
        return PackedW4(self.packed, self.scales, self.group_size, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = w4a16_matmul(x.reshape(-1, self.in_features), self.weight_packed)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"scales={self.scales.dtype}, bias={self.bias is not None}")
