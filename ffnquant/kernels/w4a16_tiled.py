"""Triton W4A16 on the tiled layout (`w4a16_repack.TiledW4`): the project's W4A16 kernel for decode and prefill.

Same numerics as `ffnquant.kernels.w4a16` (ffnquant's symmetric int4 groups, w = (q - 8) * stored scale):
products are formed from the integer (q - 8), exact in fp16/bf16/fp32, with float32 accumulation, and the
group scale multiplies the float32 partial of each K step (a step never straddles groups); a dequantized
weight is never rounded to the activation dtype. The only differences from `w4a16_reference` are float32
summation order and the final rounding to x's dtype. Asymmetric groups (the `w4a16-g*-asym` presets,
w = (q - zp) * s with an integer zp per group and column) run the same kernels with ASYM on: the codes are
converted as above and each K step adds (8 - zp) * (the step's float32 row sum of x) to its partial before
the scale, since sum x (q - zp) = sum x (q - 8) + (8 - zp) sum x (`w4a16_repack.matmul_error_bound` derives
the tolerance with that term).

Why a new layout: the old `dot` path loads codes as [SUB/2, BLOCK_N] bytes strided by K/2 per column and
rebuilds k order with join/permute/reshape every step. Here the codes are repacked once, offline, so that one
K step of one layout tile is ONE contiguous block_k * block_n / 2-byte chunk (the next step's chunk follows it),
the scales are transposed to [k/g, n_pad] (one contiguous row per step), and n is padded so that no load is
masked. Inside a word, nibble i holds the code of k = k0 + i * block_k/8 + j, so the words shifted by 4i ARE
the tile in k order. Kernels:
- `dot` ([BLOCK_M, BLOCK_N] tiles, BLOCK_M >= 16: padded rows of x cost no memory traffic): each step extracts
  nibbles i and i + 4 of every word at once (mask 0x000F000F), giving the first and second halves of the
  step's K range; with x in fp16 both halves become floats with the 1024 + q exponent trick (an OR and a
  subtract per code, two codes per 32-bit op), else with the 2**23 + q float32 trick. Two chained `tl.dot`s
  (one per half, x loaded as two contiguous half tiles) give the float32 partial, scaled per column.
  Triton pipelines the loads that feed the dots (num_stages); the scale row is prefetched one step ahead.
- `gemv` (one row of x per program, no tensor cores): the 2**23 trick with the nibble's power of 16 folded
  into x (exact: a power of two), one FMA per code; the next step's words are prefetched by hand.
Both split K (SPLIT_K > 1: atomic adds into a zeroed float32 buffer, then a cast; run-to-run bit differences
in the float32 sums) and both have a GATED form, act(x Wg^T) * (x Wu^T) in one launch (no K split there).
Without a GPU, tests/test_kernels_w4a16_tiled.py compiles them for sm_90 on the CPU and checks the generated
code for what this design relies on: codes arriving by cp.async (pipelined), the fp16 conversion packed as
f16x2 (two codes per instruction), the products on tensor cores (mma).

One layout per weight: the repack depends on (block_n, block_k), so a weight is repacked ONCE at load with
block_n = 64 and block_k = min(128, power-of-two part of the group), and every kernel tile reads that layout:
a BLOCK_N below 64 reads a column slice of a layout tile (runs of >= 64 contiguous bytes), one above reads
several whole tiles; the K step is the layout's block_k (the largest step that stays inside one group). n is
padded to a multiple of 128 (the widest kernel tile), so every BLOCK_N divides it. One copy of the weight
serves every M bucket; the tuner only picks among launch configs.

The launch configs and their tuner are in `w4a16_tune`. Speed figures for this kernel wait for a GPU run of
`benchmarks/w4a16_kernels.py`; none are claimed here.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ..errors import FFNQuantError, unknown_choice
from .tritonenv import import_triton, interpreting, jit_per_mode
from .tritonmath import act, round_to
from .w4a16 import _ACT_CODE, _X_DTYPES, triton_status
from .w4a16_pack import ACTIVATIONS, SCALE_DTYPES, KeptDtypes, PackedW4, describe, pack_w4, torch_act
from .w4a16_repack import TiledW4, dequantize_tiled, repack_w4, unrepack_w4
from .w4a16_tune import TiledConfig, _candidates, _select, m_bucket, tiled_config_used  # noqa: F401 (re-exported)

__all__ = ["ACTIVATIONS", "KERNEL_BLOCK_NS", "LAYOUT_BLOCK_N", "TiledConfig", "TiledW4", "TiledW4A16Linear",
           "dequantize_tiled", "repack_w4", "tiled_config_used", "tiled_gated", "tiled_matmul", "triton_status",
           "unrepack_w4"]

LAYOUT_BLOCK_N = 64  # the layout's tile width for every weight (see the module docstring)
KERNEL_BLOCK_NS = (16, 32, 64, 128)  # divisors or multiples of the layout's tile; all divide n_pad

# set by _triton(); the kernel bodies below resolve `tl` from this module's globals
triton = None
tl = None


def _triton():
    global triton, tl
    if tl is None:
        triton, tl = import_triton("the W4A16 kernel")
    return triton


_KERNELS: dict[bool, SimpleNamespace] = {}


def _kernels(interpret: bool) -> SimpleNamespace:
    # decorated per mode on first use, with the helpers the kernels call (`tritonenv.jit_per_mode`)
    if interpret not in _KERNELS:
        jit = jit_per_mode(_triton(), globals(), (_dot_step, _word_products, act, round_to))
        _KERNELS[interpret] = SimpleNamespace(dot=jit(_dot_kernel), gemv=jit(_gemv_kernel))
    return _KERNELS[interpret]


# --- kernels ------------------------------------------------------------------------------
# Word (j, padded column c) of K step t lives at ((c // LAYOUT_N) * KT + t) * STEP + j * LAYOUT_N + c % LAYOUT_N,
# STEP = (BLOCK_K / 8) * LAYOUT_N: a layout tile's steps follow each other, so a program walks one contiguous run.
# Builtins only from triton.language (tl.full, tl.reduce with the standard combiner, tl.exp): its @jit helpers are
# bound to one mode (compiled or interpreted) when triton is imported. Our own helpers are decorated per mode.


def _dot_step(words, sh, x_lo, x_hi, XKIND: tl.constexpr, DOT_DT: tl.constexpr, HALF: tl.constexpr,
              BLOCK_N: tl.constexpr):
    # one K step of one weight: its [KW, BLOCK_N] words shifted by 0, 4, 8, 12 (`sh`, [4, 1, 1]); masking with
    # 0x000F000F then yields nibbles i and i + 4 together, the step's two halves already in k order, as (q - 8)
    v = words[None, :, :] >> sh  # [4, KW, BLOCK_N]
    if XKIND == 1:
        # two fp16 codes per int32 op: 0x6400 | q is the fp16 1024 + q; minus 1032 is q - 8, exact
        v = (v & 0x000F000F) | 0x64006400
        lo = v.to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
        hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True) - 1032.0
    else:
        # 2**23 + q as float32, then an exact cast (bf16 arithmetic on bitcast values is wrong in the interpreter)
        lo = ((v & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        hi = (((v >> 16) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    part = tl.dot(x_lo, tl.reshape(lo.to(DOT_DT), (HALF, BLOCK_N)), input_precision="ieee")
    return tl.dot(x_hi, tl.reshape(hi.to(DOT_DT), (HALF, BLOCK_N)), part, input_precision="ieee")


def _word_products(w, x0, x1, x2, x3, x4, x5, x6, x7):
    # sum over the 8 nibbles of each word of (q - 8) * 16**(i % 4) * x_i, the 16**(i % 4) already divided out of x_i:
    # OR-ing the masked nibble into 2**23's mantissa gives 2**23 + 16**(i % 4) * q exactly, no int -> float convert
    wh = w >> 16
    p = (((w & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * x0
    p += (((w & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x1
    p += (((w & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - 8390656.0) * x2
    p += (((w & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - 8421376.0) * x3
    p += (((wh & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0) * x4
    p += (((wh & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0) * x5
    p += (((wh & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - 8390656.0) * x6
    p += (((wh & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - 8421376.0) * x7
    return p


def _dot_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, w2_ptr, s2_ptr, z2_ptr, o_ptr,
    M, N, NPAD, KT, stride_xm, stride_om, iters_per_split,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, LAYOUT_N: tl.constexpr, XKIND: tl.constexpr, DOT_DT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr,
    ASYM: tl.constexpr,
):
    # ASYM (zero points zp per group and column): sum_k x_k (q_k - zp) = sum_k x_k (q_k - 8) + (8 - zp) sum_k x_k,
    # so the codes keep the symmetric conversion and each step adds xsum * (8 - zp) to its partial before the
    # scale; without ASYM none of it is traced (no loads, no math).
    KW: tl.constexpr = BLOCK_K // 8
    HALF: tl.constexpr = BLOCK_K // 2
    STEP: tl.constexpr = KW * LAYOUT_N
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # padded columns: every load in bounds, no mask
    m_ok = rm < M
    rj = tl.arange(0, KW)
    w_off = ((rn // LAYOUT_N).to(tl.int64) * KT * STEP + rn % LAYOUT_N)[None, :] + (rj * LAYOUT_N)[:, None]
    sh = (tl.arange(0, 4) * 4)[:, None, None]  # nibbles i (bits 4i) and i + 4 (bits 16 + 4i) of each word at once
    rk = tl.arange(0, HALF)
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    acc2 = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    t0 = pid_k * iters_per_split
    t1 = tl.minimum(t0 + iters_per_split, KT)
    # the scale row is too small for cp.async pipelining: prefetched one step ahead by hand (the index clamped to
    # the last step rather than masked: a redundant load is harmless)
    s_nx = tl.load(s_ptr + ((t0 * BLOCK_K) // GROUP) * NPAD + rn)
    s2_nx = s_nx
    z_nx = s_nx
    z2_nx = s_nx
    if GATED:
        s2_nx = tl.load(s2_ptr + ((t0 * BLOCK_K) // GROUP) * NPAD + rn)
    if ASYM:  # zero points prefetched like the scales
        z_nx = tl.load(z_ptr + ((t0 * BLOCK_K) // GROUP) * NPAD + rn)
        if GATED:
            z2_nx = tl.load(z2_ptr + ((t0 * BLOCK_K) // GROUP) * NPAD + rn)
    for t in range(t0, t1):
        s = s_nx.to(tl.float32)
        s_row = ((tl.minimum(t + 1, KT - 1) * BLOCK_K) // GROUP) * NPAD
        s_nx = tl.load(s_ptr + s_row + rn)
        xo = x_rows + (t * BLOCK_K + rk)[None, :]
        x_lo = tl.load(xo, mask=m_ok[:, None], other=0.0).to(DOT_DT)  # k0 .. k0 + HALF: nibbles 0..3
        x_hi = tl.load(xo + HALF, mask=m_ok[:, None], other=0.0).to(DOT_DT)  # k0 + HALF .. k0 + BLOCK_K: nibbles 4..7
        if ASYM:
            # the step's row sums of x in float32 (x's values are exact there); the gated up weight reuses them
            xs = (tl.reduce(x_lo.to(tl.float32), 1, tl.standard._sum_combine)
                  + tl.reduce(x_hi.to(tl.float32), 1, tl.standard._sum_combine))[:, None]
            zc = 8.0 - z_nx.to(tl.float32)
            z_nx = tl.load(z_ptr + s_row + rn)
        part = _dot_step(tl.load(w_ptr + w_off + t * STEP), sh, x_lo, x_hi, XKIND, DOT_DT, HALF, BLOCK_N)
        if ASYM:
            part += xs * zc[None, :]
        acc += part * s[None, :]
        if GATED:
            s = s2_nx.to(tl.float32)
            s2_nx = tl.load(s2_ptr + s_row + rn)
            if ASYM:
                zc = 8.0 - z2_nx.to(tl.float32)
                z2_nx = tl.load(z2_ptr + s_row + rn)
            part = _dot_step(tl.load(w2_ptr + w_off + t * STEP), sh, x_lo, x_hi, XKIND, DOT_DT, HALF, BLOCK_N)
            if ASYM:
                part += xs * zc[None, :]
            acc2 += part * s[None, :]
    res = acc
    if GATED:
        res = act(res, ACT) * acc2
    out = o_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    omask = m_ok[:, None] & (rn < N)[None, :]
    if ATOMIC:
        tl.atomic_add(out, res, mask=omask)
    else:
        # rounded as torch rounds (the interpreter truncates float32 -> bf16), so the cast in the store is exact
        tl.store(out, round_to(res, XKIND).to(o_ptr.dtype.element_ty), mask=omask)


def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, w2_ptr, s2_ptr, z2_ptr, o_ptr,
    N, NPAD, KT, stride_xm, stride_om, iters_per_split,
    GROUP: tl.constexpr, BLOCK_K: tl.constexpr, LAYOUT_N: tl.constexpr, XKIND: tl.constexpr,
    BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, ASYM: tl.constexpr,
):
    # One row m of x; the step's words are a [KW, BLOCK_N] tile and x's BLOCK_K values are eight contiguous runs
    # of KW (nibble i of word j is k0 + i * KW + j). (bits & (15 << 4i)) | 2**23, minus 2**23 + 8 * 16**i, is
    # 16**i * (q - 8) exactly (16**3 * 15 < 2**23); the 16**-i goes into x (exact), so each code costs an AND,
    # an OR, a subtract and one FMA, with no shift per nibble. ASYM: as in the dot kernel, word row j's partial
    # gains (8 - zp) * (the sum of its eight x values), one more FMA per word.
    KW: tl.constexpr = BLOCK_K // 8
    STEP: tl.constexpr = KW * LAYOUT_N
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rj = tl.arange(0, KW)
    w_off = ((rn // LAYOUT_N).to(tl.int64) * KT * STEP + rn % LAYOUT_N)[None, :] + (rj * LAYOUT_N)[:, None]
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.full([KW, BLOCK_N], 0.0, tl.float32)
    acc2 = tl.full([KW, BLOCK_N], 0.0, tl.float32)
    t0 = pid_k * iters_per_split
    t1 = tl.minimum(t0 + iters_per_split, KT)
    # no tl.dot in this loop, so Triton's pipeliner does not prefetch: the next step's words are loaded by hand
    # before this step's math (index clamped to the split's last step: a redundant load at the end)
    w_nx = tl.load(w_ptr + w_off + t0 * STEP)
    s_nx = tl.load(s_ptr + ((t0 * BLOCK_K) // GROUP) * NPAD + rn)
    w2_nx = w_nx
    s2_nx = s_nx
    z_nx = s_nx
    z2_nx = s_nx
    if GATED:
        w2_nx = tl.load(w2_ptr + w_off + t0 * STEP)
        s2_nx = tl.load(s2_ptr + ((t0 * BLOCK_K) // GROUP) * NPAD + rn)
    if ASYM:
        z_nx = tl.load(z_ptr + ((t0 * BLOCK_K) // GROUP) * NPAD + rn)
        if GATED:
            z2_nx = tl.load(z2_ptr + ((t0 * BLOCK_K) // GROUP) * NPAD + rn)
    for t in range(t0, t1):
        w = w_nx
        s = s_nx.to(tl.float32)
        w2 = w2_nx
        s2 = s2_nx.to(tl.float32)
        tn = tl.minimum(t + 1, t1 - 1)
        w_nx = tl.load(w_ptr + w_off + tn * STEP)
        s_nx = tl.load(s_ptr + ((tn * BLOCK_K) // GROUP) * NPAD + rn)
        if GATED:
            w2_nx = tl.load(w2_ptr + w_off + tn * STEP)
            s2_nx = tl.load(s2_ptr + ((tn * BLOCK_K) // GROUP) * NPAD + rn)
        if ASYM:
            zc = 8.0 - z_nx.to(tl.float32)
            z_nx = tl.load(z_ptr + ((tn * BLOCK_K) // GROUP) * NPAD + rn)
            if GATED:
                zc2 = 8.0 - z2_nx.to(tl.float32)
                z2_nx = tl.load(z2_ptr + ((tn * BLOCK_K) // GROUP) * NPAD + rn)
        xb = x_row + t * BLOCK_K + rj
        r0 = tl.load(xb).to(tl.float32)
        r1 = tl.load(xb + KW).to(tl.float32)
        r2 = tl.load(xb + 2 * KW).to(tl.float32)
        r3 = tl.load(xb + 3 * KW).to(tl.float32)
        r4 = tl.load(xb + 4 * KW).to(tl.float32)
        r5 = tl.load(xb + 5 * KW).to(tl.float32)
        r6 = tl.load(xb + 6 * KW).to(tl.float32)
        r7 = tl.load(xb + 7 * KW).to(tl.float32)
        x0 = r0[:, None]
        x1 = (r1 * 0.0625)[:, None]
        x2 = (r2 * 0.00390625)[:, None]
        x3 = (r3 * 0.000244140625)[:, None]
        x4 = r4[:, None]
        x5 = (r5 * 0.0625)[:, None]
        x6 = (r6 * 0.00390625)[:, None]
        x7 = (r7 * 0.000244140625)[:, None]
        if ASYM:  # word row j's eight x values, unscaled, summed in float32
            xs = (((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)))[:, None]
        p = _word_products(w, x0, x1, x2, x3, x4, x5, x6, x7)
        if ASYM:
            p += xs * zc[None, :]
        acc += p * s[None, :]
        if GATED:
            p = _word_products(w2, x0, x1, x2, x3, x4, x5, x6, x7)
            if ASYM:
                p += xs * zc2[None, :]
            acc2 += p * s2[None, :]
    res = tl.reduce(acc, 0, tl.standard._sum_combine)
    if GATED:
        res = act(res, ACT) * tl.reduce(acc2, 0, tl.standard._sum_combine)
    out = o_ptr + m.to(tl.int64) * stride_om + rn
    n_ok = rn < N
    if ATOMIC:
        tl.atomic_add(out, res, mask=n_ok)
    else:
        tl.store(out, round_to(res, XKIND).to(o_ptr.dtype.element_ty), mask=n_ok)


# --- launching ----------------------------------------------------------------------------


def _check_call(x: torch.Tensor, t: TiledW4) -> None:
    if not isinstance(t, TiledW4):
        hint = " (repack a PackedW4 with repack_w4 first)" if isinstance(t, PackedW4) else ""
        raise FFNQuantError(f"the tiled W4A16 kernel takes a TiledW4 weight, got {describe(t)}{hint}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise FFNQuantError(f"w4a16 needs x as a 2-D float16, bfloat16 or float32 [M, K] tensor, got {describe(x)}")
    if x.shape[1] != t.k:
        raise FFNQuantError(f"x has {x.shape[1]} features but the weight takes {t.k}")
    shape = (t.n_pad // t.block_n, t.k // t.block_k, t.block_k // 8, t.block_n)
    if t.words.dtype != torch.int32 or tuple(t.words.shape) != shape or not t.words.is_contiguous():
        raise FFNQuantError(f"tiled codes must be contiguous int32 {list(shape)}, got {describe(t.words)}")
    if tuple(t.scales.shape) != (t.k // t.group_size, t.n_pad) or t.scales.dtype not in SCALE_DTYPES \
            or not t.scales.is_contiguous():
        raise FFNQuantError(f"tiled scales must be contiguous float [{t.k // t.group_size}, {t.n_pad}], "
                            f"got {describe(t.scales)}")
    zp = t.zero_points
    if zp is not None and (zp.dtype != torch.uint8 or tuple(zp.shape) != tuple(t.scales.shape)
                           or not zp.is_contiguous()):
        raise FFNQuantError(f"tiled zero points must be contiguous uint8 {list(t.scales.shape)} (or None: symmetric), "
                            f"got {describe(zp)}")
    if t.words.device != x.device or t.scales.device != x.device or (zp is not None and zp.device != x.device):
        raise FFNQuantError(f"x is on {x.device} but the weight is on {t.words.device}; move one of them")
    if x.device.type == "cpu" and not interpreting():
        raise FFNQuantError("the Triton W4A16 kernel runs on CUDA tensors, or on CPU tensors with TRITON_INTERPRET=1")
    if x.device.type not in ("cpu", "cuda"):
        raise FFNQuantError(f"the Triton W4A16 kernel runs on cuda or cpu (interpreter) tensors, not {x.device.type}")


def _check_config(cfg: TiledConfig, m: int, gated: bool) -> None:
    if cfg.path not in ("dot", "gemv"):
        raise unknown_choice("kernel path", cfg.path, ("dot", "gemv"))
    if cfg.block_n not in KERNEL_BLOCK_NS:
        raise FFNQuantError(f"kernel block_n {cfg.block_n} is not valid; valid: {', '.join(map(str, KERNEL_BLOCK_NS))}")
    if cfg.path == "dot" and (cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1)):
        raise FFNQuantError(f"dot block_m {cfg.block_m} must be a power of two >= 16 (tl.dot's smallest tile)")
    if cfg.path == "gemv" and m > 65535:  # rows of x are grid axis 1
        raise FFNQuantError(f"the gemv kernel takes at most 65535 rows of x, got {m}; use the dot path")
    if not isinstance(cfg.split_k, int) or cfg.split_k < 1:
        raise FFNQuantError(f"split_k must be a positive integer, got {cfg.split_k!r}")
    if gated and cfg.split_k != 1:
        raise FFNQuantError("the gated kernel cannot split K (the activation needs the whole sum); use split_k=1")


def _launch(cfg: TiledConfig, x: torch.Tensor, t: TiledW4, t2: TiledW4 | None = None, act: str = "identity",
            gated: bool = False) -> torch.Tensor:
    m = x.shape[0]
    _check_config(cfg, m, gated)
    kern = _kernels(interpreting())
    kt = t.k // t.block_k
    per = -(-kt // cfg.split_k)
    splits = -(-kt // per)  # every split has at least one K step
    atomic = splits > 1
    if atomic:  # partial sums meet in float32, then one cast
        out = torch.zeros((m, t.n), dtype=torch.float32, device=x.device)
    else:
        out = torch.empty((m, t.n), dtype=x.dtype, device=x.device)
    q2 = t2 if t2 is not None else t
    asym = t.zero_points is not None
    common = {"GROUP": t.group_size, "BLOCK_K": t.block_k, "LAYOUT_N": t.block_n, "XKIND": _X_DTYPES[x.dtype],
              "BLOCK_N": cfg.block_n, "ATOMIC": atomic, "GATED": gated, "ACT": _ACT_CODE[act], "ASYM": asym,
              "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    # symmetric: the zero point pointers are never read (ASYM is off); the scales stand in for them
    z, z2 = (t.zero_points, q2.zero_points) if asym else (t.scales, q2.scales)
    ptrs = (x, t.words, t.scales, z, q2.words, q2.scales, z2, out)
    if cfg.path == "dot":
        grid = (t.n_pad // cfg.block_n, -(-m // cfg.block_m), splits)
        kern.dot[grid](*ptrs, m, t.n, t.n_pad, kt, x.stride(0), out.stride(0), per,
                       DOT_DT=_dot_dtype(x.dtype), BLOCK_M=cfg.block_m, **common)
    else:
        grid = (t.n_pad // cfg.block_n, m, splits)
        kern.gemv[grid](*ptrs, t.n, t.n_pad, kt, x.stride(0), out.stride(0), per, **common)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _dot_dtype(dt: torch.dtype):
    # x's own dtype, except bf16 under the interpreter, whose bf16 tl.dot returns garbage (triton 3.9); float32
    # operands give the same products there (bf16 x small integer is exact in float32)
    if dt == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dt]


def _prepare(x: torch.Tensor, t: TiledW4) -> torch.Tensor:
    _check_call(x, t)
    _triton()
    return x if x.stride(1) == 1 else x.contiguous()


def tiled_matmul(x: torch.Tensor, t: TiledW4, config: TiledConfig | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x.dtype (float16, bfloat16 or float32), float32 accumulation.

    `config` forces a launch config (tests, benchmarks); by default one is measured per M bucket and cached.
    """
    x = _prepare(x, t)
    if x.shape[0] == 0 or t.n == 0:
        return torch.zeros((x.shape[0], t.n), dtype=x.dtype, device=x.device)

    def launch(cfg: TiledConfig) -> torch.Tensor:
        return _launch(cfg, x, t)

    return launch(config or _select(x, t, launch, gated=False))


def tiled_gated(x: torch.Tensor, t_gate: TiledW4, t_up: TiledW4, act: str = "silu",
                config: TiledConfig | None = None) -> torch.Tensor:
    """act(x @ Wg^T) * (x @ Wu^T) in one launch (both weights, repacked alike, read by the same program)."""
    torch_act(act)  # validates the name
    x = _prepare(x, t_gate)
    _check_call(x, t_up)
    same = ("n", "k", "group_size", "block_n", "block_k")
    if any(getattr(t_gate, a) != getattr(t_up, a) for a in same) or t_gate.scales.dtype != t_up.scales.dtype:
        raise FFNQuantError("gate and up weights must share shape, group size, tiles and scale dtype")
    if t_gate.symmetric != t_up.symmetric:
        raise FFNQuantError("gate and up weights must both have zero points (asymmetric) or both none (symmetric)")
    if config is not None:
        _check_config(config, x.shape[0], gated=True)
    if x.shape[0] == 0 or t_gate.n == 0:
        return torch.zeros((x.shape[0], t_gate.n), dtype=x.dtype, device=x.device)

    def launch(cfg: TiledConfig) -> torch.Tensor:
        return _launch(cfg, x, t_gate, t_up, act, gated=True)

    return launch(config or _select(x, t_gate, launch, gated=True))


# --- module -------------------------------------------------------------------------------


class TiledW4A16Linear(KeptDtypes):
    """nn.Linear replacement with int4 weights (ffnquant's int4 groups, symmetric or not) in the tiled layout.

    Buffers: `words` (int32, the TiledW4 layout), `scales` ([in/g, out padded], float16 by default),
    `zero_points` (uint8, same shape; None when symmetric) and `bias` (or None). Repacked once here, for every M
    (see the module docstring). The scales keep their dtype through `module.to(dtype)` / `.half()`: they are the
    numerics of record.
    """

    kept_dtypes = ("scales",)

    def __init__(self, linear: torch.nn.Linear, group_size: int, device=None,
                 scale_dtype: torch.dtype = torch.float16, symmetric: bool = True) -> None:
        super().__init__()
        if not isinstance(linear, torch.nn.Linear):
            raise FFNQuantError(f"TiledW4A16Linear wraps a torch.nn.Linear, got {type(linear).__name__}")
        packed = pack_w4(linear.weight.detach().float().cpu(), group_size, scale_dtype, symmetric)
        t = repack_w4(packed, LAYOUT_BLOCK_N)
        self.in_features, self.out_features, self.group_size = t.k, t.n, group_size
        self.block_n, self.block_k = t.block_n, t.block_k
        dev = torch.device(device) if device is not None else linear.weight.device
        self.register_buffer("words", t.words.to(dev))
        self.register_buffer("scales", t.scales.to(dev))
        self.register_buffer("zero_points", None if t.zero_points is None else t.zero_points.to(dev))
        bias = linear.bias.detach().clone().to(dev) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    @property
    def weight_tiled(self) -> TiledW4:
        """The buffers as a TiledW4 (views, no copy)."""
        return TiledW4(self.words, self.scales, self.group_size, self.out_features, self.in_features, self.block_n,
                       self.block_k, self.zero_points)

    @property
    def weight_packed(self) -> PackedW4:
        """The weight as the PackedW4 it was repacked from (a copy, for references and the old kernel)."""
        return unrepack_w4(self.weight_tiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = tiled_matmul(x.reshape(-1, self.in_features), self.weight_tiled)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"tiles={self.block_n}x{self.block_k}, scales={self.scales.dtype}, "
                f"{'symmetric' if self.zero_points is None else 'asymmetric'}, bias={self.bias is not None}")
