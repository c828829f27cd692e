"""The tiled W4A16 layout (`TiledW4`): int4 codes and scales repacked offline into the order the kernel reads them.

Pure torch (importable without Triton): the repack, its exact inverse, an independent dequantization, and the
error bound a kernel's output is checked against (shared by the tests and `benchmarks/w4a16_kernels.py`).

Layout, for tile sizes (block_n, block_k) with block_k a power of two from 32 to 128 dividing the group's
power-of-two part (so a K step never straddles two groups) and KW = block_k / 8 words per column per step:

    words        int32 [n_pad / block_n, k / block_k, KW, block_n]
    scales             [k / group_size, n_pad]   (the stored scales transposed: one contiguous row per K step)
    zero_points  uint8 [k / group_size, n_pad]   (asymmetric groups only, transposed alike; None: symmetric, 8)

so the codes a program needs for one K step of one column tile are ONE contiguous block_k * block_n / 2-byte
chunk, and the next step's chunk follows it. Inside a column's word j of step t, nibble i (bits 4i..4i+3) holds
the code of k = t * block_k + i * KW + j: `(words[None] >> 4 * i[:, None, None]) & 15` reshaped to
[block_k, block_n] is the tile in k order, with no interleave or transpose in the kernel. n is padded to
n_pad (a multiple of max(block_n, 128), the largest kernel tile) with code 8, zero point 8 and scale 0
(weight 0), so the kernel loads codes, scales and zero points without masks (full-width vector loads) and
only masks its stores; the cost is under 128 columns of zeros per weight.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..errors import FFNQuantError
from ..numerics.primitives import pack_int4, unpack_int4
from .w4a16_pack import PackedW4, dequantize_w4, describe, torch_act, zero_point_values

__all__ = ["BLOCK_KS", "BLOCK_NS", "MAX_KERNEL_BLOCK_N", "TiledW4", "abs_terms", "check_tiles", "default_block_k",
           "dequantize_tiled", "gated_error_bound", "matmul_error_bound", "repack_w4", "ulp", "unrepack_w4"]

BLOCK_NS = (16, 32, 64, 128, 256)
BLOCK_KS = (32, 64, 128)  # >= 32: a step is two tl.dots of depth >= 16; <= 128: a step's tile stays in registers
MAX_KERNEL_BLOCK_N = 128  # n is padded to a multiple of this, so every kernel tile width divides n_pad


@dataclass(frozen=True)
class TiledW4:
    """A [n, k] int4 weight in the tiled layout (see the module docstring); lossless w.r.t. its PackedW4."""

    words: torch.Tensor  # int32 [n_pad // block_n, k // block_k, block_k // 8, block_n]
    scales: torch.Tensor  # [k // group_size, n_pad], the PackedW4's dtype; 0 on padded columns
    group_size: int
    n: int
    k: int
    block_n: int
    block_k: int
    zero_points: torch.Tensor | None = None  # uint8 [k // group_size, n_pad], 8 on padded columns; None: symmetric

    @property
    def symmetric(self) -> bool:
        return self.zero_points is None

    @property
    def n_pad(self) -> int:
        return self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads for the whole weight (padding included)."""
        zp = 0 if self.zero_points is None else self.zero_points.numel()
        return self.words.numel() * 4 + self.scales.numel() * self.scales.element_size() + zp

    def to(self, device) -> TiledW4:
        """The same weight on `device`."""
        zp = None if self.zero_points is None else self.zero_points.to(device)
        return replace(self, words=self.words.to(device), scales=self.scales.to(device), zero_points=zp)


def _pow2_part(g: int) -> int:
    return g & -g


def default_block_k(group_size: int) -> int:
    """The layout's K step for a group size: its power-of-two part, at most 128 (the kernel's widest step)."""
    return min(128, _pow2_part(group_size))


def check_tiles(group_size: int, block_n: int, block_k: int) -> None:
    """Refuse tile sizes the layout cannot take for this group size, naming the valid ones."""
    pg = _pow2_part(group_size) if isinstance(group_size, int) and group_size > 0 else 0
    if pg < 32:
        raise FFNQuantError(f"the tiled W4A16 kernel needs group_size a positive multiple of 32 (a K step is "
                            f"two tl.dots of >= 16 codes inside one group), got {group_size!r}; "
                            "valid: 32, 64, 96, 128, ...")
    if block_n not in BLOCK_NS:
        raise FFNQuantError(f"block_n {block_n!r} is not a valid tile width; valid: {', '.join(map(str, BLOCK_NS))}")
    valid_k = [b for b in BLOCK_KS if b <= pg]
    if block_k not in valid_k:
        raise FFNQuantError(f"block_k {block_k!r} must be a power of two from 32 to 128 dividing group_size "
                            f"{group_size}'s power-of-two part {pg}; valid: {', '.join(map(str, valid_k))}")


def repack_w4(p: PackedW4, block_n: int = 64, block_k: int | None = None) -> TiledW4:
    """PackedW4 -> TiledW4 with (block_n, block_k) tiles (block_k defaults to `default_block_k(group_size)`)."""
    if not isinstance(p, PackedW4):
        raise FFNQuantError(f"repack_w4 takes a PackedW4 (from pack_w4), got {describe(p)}")
    block_k = default_block_k(p.group_size) if block_k is None else block_k
    check_tiles(p.group_size, block_n, block_k)
    if p.k % p.group_size or tuple(p.packed.shape) != (p.n, p.k // 2):
        raise FFNQuantError(f"packed codes must be uint8 [{p.n}, {p.k // 2}] with group_size {p.group_size} "
                            f"dividing k={p.k}, got {describe(p.packed)}")
    zp = p.zero_points
    if zp is not None and (zp.dtype not in (torch.uint8, torch.int8) or tuple(zp.shape) != tuple(p.scales.shape)
                           or zp.device != p.scales.device):
        raise FFNQuantError(f"zero points must be uint8 or int8 {list(p.scales.shape)} on {p.scales.device} "
                            f"(or None: symmetric), got {describe(zp)}")
    if zp is not None and zp.numel() and (zp.min() < 0 or zp.max() > 15):
        raise FFNQuantError(f"zero points must be integers 0..15, got {zp.min().item()}..{zp.max().item()}")
    n, k = p.n, p.k
    unit = max(block_n, MAX_KERNEL_BLOCK_N)
    n_pad = -(-n // unit) * unit if n else 0
    kw, kt = block_k // 8, k // block_k
    q = torch.full((n_pad, k), 8, dtype=torch.int64, device=p.packed.device)
    q[:n] = unpack_int4(p.packed, signed=False).to(torch.int64)
    # [tn, c, t, i, j] -> [tn, t, j, c, i]: words[tn, t, j, c] gathers nibble i = code of k = t*block_k + i*kw + j
    q = q.reshape(n_pad // block_n, block_n, kt, 8, kw).permute(0, 2, 4, 1, 3)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)
    v = (q << shifts).sum(dim=-1)
    v = torch.where(v >= 2**31, v - 2**32, v)  # the same 32 bits as a signed int32 (no reliance on cast wraparound)
    scales = torch.zeros((k // p.group_size, n_pad), dtype=p.scales.dtype, device=p.scales.device)
    scales[:, :n] = p.scales.T
    zps = None
    if zp is not None:
        zps = torch.full((k // p.group_size, n_pad), 8, dtype=torch.uint8, device=zp.device)
        zps[:, :n] = zp.T.to(torch.uint8)
    return TiledW4(v.to(torch.int32).contiguous(), scales, p.group_size, n, k, block_n, block_k, zps)


def _codes(t: TiledW4) -> torch.Tensor:
    """int64 codes [n_pad, k] read back from the words with the nibble formula of the module docstring."""
    w = t.words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=w.device)
    q = (w.unsqueeze(-1) >> shifts) & 15  # [tn, t, j, c, i]
    return q.permute(0, 3, 1, 4, 2).reshape(t.n_pad, t.k)  # [tn, c, t, i, j]


def unrepack_w4(t: TiledW4) -> PackedW4:
    """TiledW4 -> the PackedW4 it was made from (bit for bit; int8 zero points come back as uint8)."""
    q = _codes(t)[: t.n]
    zp = None if t.zero_points is None else t.zero_points[:, : t.n].T.contiguous()
    return PackedW4(pack_int4(q).contiguous(), t.scales[:, : t.n].T.contiguous(), t.group_size, t.n, t.k, zp)


def dequantize_tiled(t: TiledW4, dtype: torch.dtype = torch.float32, padded: bool = False) -> torch.Tensor:
    """The [n, k] weight (q - zp) * scale (zp = 8 when symmetric) straight from the tiled layout (n_pad rows if
    `padded`), float32 then `dtype`.

    Independent of `unrepack_w4`: each k's scale and zero point row is indexed here as the kernel indexes it
    (k // group_size).
    """
    zp = zero_point_values(t.zero_points, t.scales.shape, t.scales.device).T.repeat_interleave(t.group_size, dim=1)
    q = _codes(t).to(torch.float32) - zp
    s = t.scales.to(torch.float32).T.repeat_interleave(t.group_size, dim=1)
    w = q * s
    return (w if padded else w[: t.n]).to(dtype)


# --- the derived tolerance (tests/test_kernels_w4a16.py's docstring) ------------------------------


def ulp(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of `dtype` at |y| (at least its smallest subnormal step)."""
    fi = torch.finfo(dtype)
    mag = y.abs().clamp(min=fi.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * fi.eps


def abs_terms(p: PackedW4) -> torch.Tensor:
    """(|q - 8| + |8 - zp|) * |s| [n, k] in float32: per weight, the magnitudes of the leaf terms the kernel sums
    (|w| itself for symmetric groups, where zp = 8)."""
    q = unpack_int4(p.packed, signed=False).reshape(p.n, p.k // p.group_size, p.group_size).to(torch.float32)
    zp = zero_point_values(p.zero_points, p.scales.shape, p.scales.device).unsqueeze(-1)
    a = ((q - 8.0).abs() + (8.0 - zp).abs()) * p.scales.to(torch.float32).abs().unsqueeze(-1)
    return a.reshape(p.n, p.k)


def matmul_error_bound(x: torch.Tensor, p: PackedW4, ref: torch.Tensor, out_dtype: torch.dtype,
                       u: float = 2.0**-24) -> torch.Tensor:
    """2 * gamma_{K+2} * |x| @ abs_terms(p)^T + one ulp of the output dtype at |ref|; gamma_n = n u / (1 - n u).

    Per output the kernel evaluates y = sum_t s_t * (D_t + c_t * X_t) in float32: K step t (inside one group)
    has D_t = sum_k x_k (q_k - 8), X_t = sum_k x_k and c_t = 8 - zp_t (asymmetric groups; the term is absent
    when symmetric). Expanded, y is a sum of exact leaves x_k (q_k - 8) s_t and x_k c_t s_t; any float32
    evaluation tree in which each leaf passes through at most m roundings (a factor 1 + d, |d| <= u, each) is
    within gamma_m * sum |leaves| of y. A leaf's roundings: its product or the c * X product (1), the step's
    inner sum (<= BLOCK_K - 1), the add of c * X to D (1), the scale (1), the sum over steps, split or not
    (<= KT - 1): BLOCK_K + KT + 1 <= K + 2, since (KT - 1)(BLOCK_K - 1) >= 0 (gemv: 8-term chains, then a
    reduction over KW word rows: KT + KW + 8 <= K + 2 too). sum |leaves| = |x| @ abs_terms^T. The reference
    sums x_k w_k, w = (q - zp) s, in another order (<= K + 1 roundings, weight rounding included) and
    |w| <= abs_terms (|q - zp| <= |q - 8| + |8 - zp|): the two differ by at most twice the kernel's bound. Each
    result is then rounded to the output dtype (half an ulp each). For symmetric groups abs_terms = |w|: the
    bound the kernel had before zero points. The asymmetric term is not tuned away: D_t and c_t X_t may cancel,
    and the bound says so. u = 2**-24 for IEEE float32; 2**-23 on a GPU, whose tensor-core accumulation is not
    round-to-nearest.
    """
    n_terms = p.k + 2
    gamma = n_terms * u / (1 - n_terms * u)
    absdot = x.float().abs() @ abs_terms(p).to(x.device).T
    return 2 * gamma * absdot + ulp(ref.float(), out_dtype)


# the largest slope of the activations (gelu: 1.129; silu: 1.0998; the others <= 1)
_LIPSCHITZ = 1.13


def gated_error_bound(x: torch.Tensor, p_gate: PackedW4, p_up: PackedW4, act: str, ref: torch.Tensor,
                      out_dtype: torch.dtype, u: float = 2.0**-24) -> torch.Tensor:
    """The bound of act(g) * u: each sum's error as above, carried through act (slope <= 1.13) and the product.

    Plus a few float32 ulps for the activation's own evaluation (Triton's exp/erf vs torch's; gelu_tanh as
    z * sigmoid(2v), equal to torch's formula in exact math) and one ulp of the output dtype.
    """
    xf = x.float()
    wg, wu = dequantize_w4(p_gate).to(x.device), dequantize_w4(p_up).to(x.device)
    g, up = xf @ wg.T, xf @ wu.T
    n_terms = p_gate.k + 2
    gamma = n_terms * u / (1 - n_terms * u)
    e_g = 2 * gamma * (xf.abs() @ abs_terms(p_gate).to(x.device).T)  # matmul_error_bound's, per sum
    e_u = 2 * gamma * (xf.abs() @ abs_terms(p_up).to(x.device).T)
    a = torch_act(act)(g)
    bound = _LIPSCHITZ * e_g * up.abs() + (a.abs() + _LIPSCHITZ * e_g) * e_u + 16 * 2.0**-24 * (g.abs() + 1) * up.abs()
    return bound + ulp(ref.float(), out_dtype)
