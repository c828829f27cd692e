"""Launch configs of the tiled W4A16 kernel (`w4a16_tiled`) and the tuner that picks one per M bucket.

The tuner times the candidates of an (M bucket, N, K) as CUDA-graph replays with a cold L2 (`tritonenv.time_call`)
and caches the fastest; during a graph capture the bucket's first candidate runs untimed. Under
TRITON_INTERPRET=1 (CPU tensors) a fixed small config runs and nothing is timed. Symmetric and asymmetric
weights are tuned apart (the asymmetric kernel is another compilation with more work per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tritonenv import fastest, interpreting
from .w4a16_repack import TiledW4

__all__ = ["TiledConfig", "m_bucket", "tiled_config_used"]


@dataclass(frozen=True)
class TiledConfig:
    """One launch config on the tiled layout (the K step is the layout's block_k)."""

    path: str  # "dot" or "gemv"
    block_m: int  # rows of x per program: 1 for gemv, a power of two >= 16 for dot
    block_n: int  # one of KERNEL_BLOCK_NS
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def m_bucket(m: int) -> int:
    """The tuner's M bucket: 1, 2-4, 5-16, 17-64, 65+ (named by their upper end, 65+ as 65)."""
    return next((b for b in (1, 4, 16, 64) if m <= b), 65)


def _split(programs: int, kt: int, sms: int) -> int:
    # split K until about two programs per SM, at most 8 ways, keeping >= 2 K steps per split
    s = 1
    while s < 8 and programs * s < 2 * sms and kt >= 4 * s:
        s *= 2
    return s


def _candidates(m: int, t: TiledW4, gated: bool, sms: int = 132) -> list[TiledConfig]:
    """The configs the tuner times for this shape; the first one runs untimed during a graph capture.

    Several per bucket on purpose: tile width, warps, stages and the K split trade off differently per GPU,
    shape and group size, and no figure measured on this layout exists yet (see the module docstring).
    """
    kt = t.k // t.block_k

    def dot(bm, bn, warps=4, stages=3, more=1):
        tiles = (t.n_pad // bn) * -(-m // bm)
        return TiledConfig("dot", bm, bn, 1 if gated else min(8, _split(tiles, kt, sms) * more), warps, stages)

    def gemv(bn, warps=4, more=1):
        tiles = (t.n_pad // bn) * m
        return TiledConfig("gemv", 1, bn, 1 if gated else min(8, _split(tiles, kt, sms) * more), warps, 1)

    b = m_bucket(m)
    # Few per bucket, mostly shared across buckets (each distinct one is a compile on first use).
    if b == 1:
        cands = [dot(16, 64), gemv(64), gemv(32), dot(16, 32, 4, 4), dot(16, 128, 8, 3)]
    elif b == 4:
        cands = [dot(16, 64), dot(16, 32, 4, 4), dot(16, 128, 8, 3), gemv(64), dot(16, 64, 4, 4, more=2)]
    elif b == 16:
        cands = [dot(16, 64), dot(16, 32, 4, 4), dot(16, 128, 8, 3), dot(16, 64, 4, 4, more=2)]
    elif b == 64:
        cands = [dot(32, 64), dot(64, 64), dot(64, 128, 8, 3), dot(16, 64, 4, 2)]
    else:
        cands = [dot(64, 128), dot(128, 128, 8, 3), dot(128, 64, 4, 4), dot(64, 64, 4, 4)]
    out: list[TiledConfig] = []
    for c in cands:
        if c not in out:
            out.append(c)
    return out


def _interpreter_config(m: int) -> TiledConfig:
    # the interpreter runs each program in numpy: small tiles, nothing timed
    return TiledConfig("gemv", 1, 32, 1, 4, 1) if m == 1 else TiledConfig("dot", 16, 32, 1, 4, 1)


_TUNED: dict[tuple, TiledConfig] = {}


def _tune_key(x: torch.Tensor, t: TiledW4, gated: bool) -> tuple:
    return (str(x.device), x.dtype, m_bucket(x.shape[0]), t.n, t.k, t.group_size, t.scales.dtype, t.block_n,
            t.block_k, gated, t.zero_points is not None)


def tiled_config_used(x: torch.Tensor, t: TiledW4, gated: bool = False) -> TiledConfig | None:
    """The config a call with this input and weight uses now (None: not tuned yet on CUDA)."""
    if interpreting():
        return _interpreter_config(x.shape[0])
    return _TUNED.get(_tune_key(x, t, gated))


def _select(x: torch.Tensor, t: TiledW4, launch, gated: bool) -> TiledConfig:
    """The cached config for this shape, else time the candidates once with `launch(cfg)` and keep the fastest."""
    m = x.shape[0]
    if interpreting():
        return _interpreter_config(m)
    key = _tune_key(x, t, gated)
    if key in _TUNED:
        return _TUNED[key]
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    cands = _candidates(m, t, gated, sms)
    if torch.cuda.is_current_stream_capturing():
        return cands[0]  # no timing inside a graph capture; the next eager call tunes
    best = fastest(cands, launch, f"tiled W4A16 kernel for M={m}, N={t.n}, K={t.k}")
    _TUNED[key] = best
    return best
