"""The tiled W4A16 layout and kernel against the torch reference, under Triton's CPU interpreter (and on CUDA).

TRITON_INTERPRET is set per test (monkeypatch), as in tests/test_kernels_w4a16.py. The tolerance is derived,
not tuned, once in `w4a16_repack.matmul_error_bound` / `gated_error_bound`: per output the kernel sums, in
float32, the exact leaves x_k (q_k - 8) s and, for asymmetric groups (zero point zp), x_k (8 - zp) s (each K
step adds (8 - zp) * sum_k x_k to its partial); every leaf passes through at most K + 2 roundings, so the sum is
within gamma_{K+2} * sum|leaves| of the exact value, and the reference (x @ ((q - zp) s)^T, another order)
within the same, as |q - zp| <= |q - 8| + |8 - zp|. Symmetric groups: sum|leaves| = sum|x w|, the bound as
before zero points. u = 2**-24; 2**-23 on a GPU, whose tensor-core accumulation is not round-to-nearest. Each
result is rounded to the output dtype (one ulp between them). The gated bound carries both sums' errors
through the activation (slope <= 1.13) and the product.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from kernel_checks import assert_within, random_x

pytest.importorskip("triton", reason="the W4A16 kernel tests need triton")

from ffnquant.errors import FFNQuantError  # noqa: E402
from ffnquant.kernels.w4a16_pack import (  # noqa: E402
    ACTIVATIONS,
    PackedW4,
    dequantize_w4,
    pack_w4,
    w4a16_gated_reference,
    w4a16_reference,
)
from ffnquant.kernels.w4a16_repack import (  # noqa: E402
    TiledW4,
    dequantize_tiled,
    gated_error_bound,
    matmul_error_bound,
    repack_w4,
    unrepack_w4,
)
from ffnquant.kernels.w4a16_tiled import (  # noqa: E402
    TiledConfig,
    TiledW4A16Linear,
    _candidates,
    m_bucket,
    tiled_config_used,
    tiled_gated,
    tiled_matmul,
)
from ffnquant.numerics.primitives import unpack_int4  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
K, N = 256, 96  # n = 96: not a multiple of the padded width (128) nor of the 64-wide layout tile


def _weight(n: int, k: int, seed: int = 0, symmetric: bool = True) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.05
    if not symmetric:
        # an offset per row spreads the asymmetric zero points over 0..15 (some groups all of one sign)
        w = w + (torch.rand(n, 1, generator=gen) - 0.5) * 0.3
    return w


def _packed(n: int, k: int, g: int, seed: int = 0, scale_dtype=torch.float16, symmetric: bool = True) -> PackedW4:
    return pack_w4(_weight(n, k, seed, symmetric), g, scale_dtype, symmetric)


def _check(x, p, t, config=None, u=2.0**-24):
    ref = w4a16_reference(x, p)
    y = tiled_matmul(x, t, config)
    assert y.dtype == x.dtype and y.shape == (x.shape[0], p.n)
    assert_within(y, ref, matmul_error_bound(x, p, ref, x.dtype, u))


# --- layout ----------------------------------------------------------------------------


REPACK_CASES = {  # (n, k, group, block_n, block_k): n never a multiple of block_n or of 128
    "n100-g128-bn16-bk32": (100, 384, 128, 16, 32),
    "n100-g128-bn64-bk128": (100, 384, 128, 64, 128),
    "n100-g128-bn256-bk64": (100, 384, 128, 256, 64),
    "n40-g96-bn32-bk32": (40, 192, 96, 32, 32),
    "n130-g64-bn64-bk64": (130, 256, 64, 64, 64),
    "n130-g64-bn128-bk32": (130, 256, 64, 128, 32),
}


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("case", REPACK_CASES.values(), ids=REPACK_CASES.keys())
def test_repack_round_trip_is_lossless(case, symmetric):
    n, k, g, bn, bk = case
    p = _packed(n, k, g, scale_dtype=torch.bfloat16, symmetric=symmetric)
    t = repack_w4(p, bn, bk)
    n_pad = -(-n // max(bn, 128)) * max(bn, 128)
    assert t.words.dtype == torch.int32 and tuple(t.words.shape) == (n_pad // bn, k // bk, bk // 8, bn)
    assert tuple(t.scales.shape) == (k // g, n_pad) and t.scales.dtype == torch.bfloat16 and t.n_pad == n_pad
    back = unrepack_w4(t)
    assert torch.equal(back.packed, p.packed) and torch.equal(back.scales, p.scales)
    assert (back.n, back.k, back.group_size) == (p.n, p.k, p.group_size)
    assert t.symmetric == back.symmetric == p.symmetric == symmetric
    if not symmetric:
        assert t.zero_points.dtype == torch.uint8 and tuple(t.zero_points.shape) == (k // g, n_pad)
        assert torch.equal(back.zero_points, p.zero_points) and (t.zero_points[:, n:] == 8).all()
        assert p.nbytes == p.packed.numel() + p.scales.numel() * 2 + p.zero_points.numel()
    assert torch.equal(dequantize_tiled(t), dequantize_w4(p))
    padded = dequantize_tiled(t, padded=True)
    assert padded.shape == (n_pad, k) and not padded[n:].any()  # padding: code 8 and scale 0, weight 0
    assert (t.scales[:, n:] == 0).all()


def test_asymmetric_packing_is_the_presets():
    # the w4a16-g*-asym presets' numerics (torch_rt.int4_groupwise_affine): (q - zp) * s, zp spread over 0..15
    from ffnquant.numerics.primitives import int4_group_rtn

    p = _packed(64, 256, 32, seed=8, scale_dtype=torch.float32, symmetric=False)
    q, scale, zp = int4_group_rtn(_weight(64, 256, seed=8, symmetric=False), 32, symmetric=False)
    assert torch.equal(unpack_int4(p.packed, signed=False), q.to(torch.uint8))
    assert torch.equal(p.zero_points, zp.squeeze(-1).to(torch.uint8)) and torch.equal(p.scales, scale.squeeze(-1))
    assert p.zero_points.min() == 0 and p.zero_points.max() == 15
    want = ((q.float().reshape(64, 8, 32) - zp.float()) * scale).reshape(64, 256)
    assert torch.equal(dequantize_w4(p), want)
    int8 = PackedW4(p.packed, p.scales, 32, 64, 256, p.zero_points.to(torch.int8))  # int8 zero points are taken too
    assert torch.equal(unrepack_w4(repack_w4(int8)).zero_points, p.zero_points)


def test_words_shifted_are_the_tile_in_k_order():
    # the property the kernel relies on: (words[None] >> 4i) & 15 reshaped to [block_k, block_n] is k order
    p = _packed(70, 256, 64)
    t = repack_w4(p, 32, 64)
    q = unpack_int4(p.packed, signed=False)  # [n, k]
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)[:, None, None]
    for tn, step in [(0, 0), (1, 3), (2, 2)]:
        tile = ((t.words[tn, step][None] >> shifts) & 15).reshape(64, 32)
        cols = slice(tn * 32, min((tn + 1) * 32, 70))
        want = torch.full((64, 32), 8, dtype=torch.int32)
        want[:, : cols.stop - cols.start] = q[cols, step * 64:(step + 1) * 64].T
        assert torch.equal(tile, want)


@pytest.mark.parametrize(
    "group,block_n,block_k,match",
    [
        (48, 64, None, "multiple of 32.*valid: 32, 64, 96, 128"),
        (128, 48, None, "block_n 48 .*valid: 16, 32, 64, 128, 256"),
        (128, 64, 256, "block_k 256 .*valid: 32, 64, 128"),
        (96, 64, 64, "block_k 64 .*power-of-two part 32; valid: 32"),
    ],
    ids=["group-48", "block-n-48", "block-k-256", "block-k-over-group"],
)
def test_repack_rejects_bad_tiles(group, block_n, block_k, match):
    p = _packed(32, 384, group)
    with pytest.raises(FFNQuantError, match=match):
        repack_w4(p, block_n, block_k)


# --- kernel vs reference ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("group", [32, 64, 128], ids=lambda g: f"g{g}")
@pytest.mark.parametrize("m", [1, 4, 16, 64], ids=lambda m: f"m{m}")
def test_matmul_matches_reference(interpret, m, group, dtype):
    p = _packed(N, K, group)
    _check(random_x(m, K, dtype), p, repack_w4(p))


def _ignoring_zero_points_fails(x, p, y):
    # the check is sensitive: the symmetric reading of the same codes (zero point 8) is outside the bound
    wrong = w4a16_reference(x, replace(p, zero_points=None))
    assert ((wrong.float() - y.float()).abs() > matmul_error_bound(x, p, wrong, x.dtype)).any()


# (m, group) all pairs, the dtype rotating so that every (m, dtype) and (group, dtype) pair occurs once or more
ASYM_CASES = [(m, g, list(DTYPES)[(i + j) % 3])
              for i, m in enumerate((1, 4, 16, 64)) for j, g in enumerate((32, 64, 128))]


@pytest.mark.parametrize("m,group,dtype", ASYM_CASES, ids=[f"m{m}-g{g}-{d}" for m, g, d in ASYM_CASES])
def test_asym_matmul_matches_reference(interpret, m, group, dtype):
    p = _packed(N, K, group, seed=9, symmetric=False)
    x = random_x(m, K, DTYPES[dtype])
    _check(x, p, repack_w4(p))
    if m == 4:
        _ignoring_zero_points_fails(x, p, tiled_matmul(x, repack_w4(p)))


@pytest.mark.parametrize(
    "config",
    [
        TiledConfig("dot", 16, 32, split_k=1),
        TiledConfig("dot", 16, 16, split_k=2),
        TiledConfig("dot", 32, 128, split_k=4),
        TiledConfig("dot", 16, 64, split_k=3),  # 2 K steps per split, the last split shorter
        TiledConfig("gemv", 1, 32, split_k=1),
        TiledConfig("gemv", 1, 128, split_k=4),
    ],
    ids=["dot-bn32", "dot-bn16-split2", "dot-bm32-bn128-split4", "dot-split3", "gemv", "gemv-bn128-split4"],
)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_tiles_and_split_k(interpret, config, dtype):
    # kernel tiles narrower (16, 32) and wider (128) than the 64-wide layout tile; K splits with atomics
    k, g = 384, 64
    p = _packed(N, k, g, seed=4)
    _check(random_x(5, k, dtype), p, repack_w4(p, 64), config)


ASYM_CONFIGS = {  # split K on and off on both paths; tiles narrower and wider than the layout's
    "dot-fp16": (TiledConfig("dot", 16, 64, split_k=1), torch.float16),
    "dot-bn16-split2-bf16": (TiledConfig("dot", 16, 16, split_k=2), torch.bfloat16),
    "dot-bm32-bn128-split3-fp32": (TiledConfig("dot", 32, 128, split_k=3), torch.float32),
    "gemv-bf16": (TiledConfig("gemv", 1, 32, split_k=1), torch.bfloat16),
    "gemv-bn128-split4-fp16": (TiledConfig("gemv", 1, 128, split_k=4), torch.float16),
}


@pytest.mark.parametrize("config,dtype", ASYM_CONFIGS.values(), ids=ASYM_CONFIGS.keys())
def test_asym_tiles_and_split_k(interpret, config, dtype):
    k, g = 384, 64
    p = _packed(N, k, g, seed=10, symmetric=False)
    _check(random_x(5, k, dtype), p, repack_w4(p, 64), config)


@pytest.mark.parametrize("m", [1, 3, 16, 40, 100], ids=lambda m: f"m{m}")
def test_every_candidate_config(interpret, m):
    # what the CUDA tuner may pick, per M bucket (split K computed for a GPU with 132 SMs)
    p = _packed(N, 512, 128, seed=5)
    t = repack_w4(p)
    configs = _candidates(m, t, gated=False)
    assert 3 <= len(configs) <= 8 and len(set(configs)) == len(configs)
    if m <= 16:
        assert any(c.split_k > 1 for c in configs)
    x = random_x(m, 512, torch.float16)
    for cfg in configs:
        _check(x, p, t, cfg)


def test_m_buckets_and_config_used(interpret):
    assert [m_bucket(m) for m in (1, 2, 4, 5, 16, 17, 64, 65, 4096)] == [1, 4, 4, 16, 16, 64, 64, 65, 65]
    t = repack_w4(_packed(32, 256, 128))
    assert tiled_config_used(random_x(1, 256, torch.float16), t).path == "gemv"
    assert tiled_config_used(random_x(8, 256, torch.float16), t).path == "dot"


def test_fp32_scales_strided_input_and_empty(interpret):
    p = _packed(64, 256, 64, scale_dtype=torch.float32)
    xt = random_x(256, 6, torch.float16).T  # [6, 256] with stride (1, 6): the wrapper makes it contiguous
    _check(xt, p, repack_w4(p))
    y = tiled_matmul(torch.zeros(0, 256, dtype=torch.float16), repack_w4(p))
    assert y.shape == (0, 64) and y.dtype == torch.float16


# --- gated (gate + up in one launch) ---------------------------------------------------


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(-z) -> inf gives the exact limit 0
@pytest.mark.parametrize("act", ACTIVATIONS)
@pytest.mark.parametrize("m", [1, 5], ids=lambda m: f"m{m}")
def test_gated_matches_reference(interpret, m, act):
    pg, pu = _packed(N, K, 64, seed=2), _packed(N, K, 64, seed=3)
    x = random_x(m, K, torch.float16) * 4  # pre-activations of a few units: both tails of each activation
    ref = w4a16_gated_reference(x, pg, pu, act)
    y = tiled_gated(x, repack_w4(pg), repack_w4(pu), act)
    assert y.shape == (m, N) and y.dtype == torch.float16
    assert_within(y, ref, gated_error_bound(x, pg, pu, act, ref, torch.float16))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gated_candidates_and_dtypes(interpret, dtype):
    pg, pu = _packed(N, K, 128, seed=2), _packed(N, K, 128, seed=3)
    tg, tu = repack_w4(pg), repack_w4(pu)
    x = random_x(5, K, dtype)
    ref = w4a16_gated_reference(x, pg, pu, "silu")
    bound = gated_error_bound(x, pg, pu, "silu", ref, dtype)
    configs = _candidates(1, tg, gated=True) + _candidates(5, tg, gated=True)
    assert configs and all(c.split_k == 1 for c in configs)
    for cfg in configs:
        assert_within(tiled_gated(x, tg, tu, "silu", config=cfg), ref, bound)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m,dtype", [(1, torch.float16), (5, torch.bfloat16), (16, torch.float32)],
                         ids=["m1-fp16", "m5-bf16", "m16-fp32"])
def test_asym_gated_matches_reference(interpret, m, dtype, act):
    pg, pu = _packed(N, K, 32, seed=11, symmetric=False), _packed(N, K, 32, seed=12, symmetric=False)
    x = random_x(m, K, dtype) * 4
    ref = w4a16_gated_reference(x, pg, pu, act)
    y = tiled_gated(x, repack_w4(pg), repack_w4(pu), act)
    assert y.shape == (m, N) and y.dtype == dtype
    assert_within(y, ref, gated_error_bound(x, pg, pu, act, ref, dtype))


# --- errors ----------------------------------------------------------------------------


def test_errors_name_what_is_valid(interpret):
    from ffnquant.kernels.w4a16 import w4a16_matmul

    p = _packed(32, 256, 64)
    t = repack_w4(p)
    pa = _packed(32, 256, 64, symmetric=False)
    ta = repack_w4(pa)
    x = random_x(2, 256, torch.float16)
    cases = [
        (lambda: tiled_matmul(torch.ones(2, 256, dtype=torch.int32), t), "float16, bfloat16 or float32"),
        (lambda: tiled_matmul(torch.randn(2, 3, 256), t), "2-D"),
        (lambda: tiled_matmul(random_x(2, 128, torch.float16), t), "x has 128 features but the weight takes 256"),
        (lambda: tiled_matmul(x, p), "takes a TiledW4 weight.*repack_w4"),
        (lambda: tiled_matmul(x, t, TiledConfig("dot", 16, 48)), "block_n 48 .*valid: 16, 32, 64, 128"),
        (lambda: tiled_matmul(x, t, TiledConfig("dot", 8, 64)), "block_m 8 .*power of two >= 16"),
        (lambda: tiled_matmul(x, t, TiledConfig("mma", 16, 64)), "unknown kernel path 'mma'; valid: dot, gemv"),
        (lambda: tiled_matmul(x, t, TiledConfig("dot", 16, 64, split_k=0)), "split_k must be a positive"),
        (lambda: tiled_gated(x, t, t, "silu", TiledConfig("dot", 16, 64, 2)), "cannot split K.*split_k=1"),
        (lambda: tiled_gated(x, t, repack_w4(p, 32), "silu"), "share shape, group size, tiles"),
        (lambda: tiled_gated(x, t, t, "swish"), "unknown activation 'swish'; valid: silu"),
        (lambda: pack_w4(torch.randn(8, 96), 64), "group_size 64 must divide the input dimension 96"),
        (lambda: repack_w4(_packed(8, 96, 24)), "multiple of 32"),
        (lambda: tiled_gated(x, t, ta, "silu"), "both have zero points .*or both none"),
        (lambda: tiled_matmul(x, replace(ta, zero_points=ta.zero_points.int())), "contiguous uint8 \\[4, 128\\]"),
        (lambda: repack_w4(replace(pa, zero_points=pa.zero_points[:, :2])), "uint8 or int8 \\[32, 4\\]"),
        (lambda: repack_w4(replace(pa, zero_points=pa.zero_points + 16)), "integers 0..15, got"),
        (lambda: w4a16_matmul(x, pa), "symmetric groups only.*w4a16_tiled"),
        (lambda: pack_w4(torch.randn(8, 64), 32, symmetric="no"), "True or False"),
    ]
    for call, match in cases:
        with pytest.raises(FFNQuantError, match=match) as info:
            call()
        assert "\n" not in str(info.value)


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(FFNQuantError, match="TRITON_INTERPRET=1"):
        tiled_matmul(torch.randn(1, 64), repack_w4(_packed(32, 64, 32)))


# --- module ----------------------------------------------------------------------------


def test_linear_with_bias_and_3d_input(interpret):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 40)
    layer = TiledW4A16Linear(lin, group_size=64).half()
    # .half() casts the bias but keeps the scales (numerics of record) and the int32 words as they are
    assert layer.scales.dtype == torch.float16 and layer.words.dtype == torch.int32
    assert layer.bias.dtype == torch.float16
    layer32 = TiledW4A16Linear(lin, group_size=64, scale_dtype=torch.float32).to(dtype=torch.bfloat16)
    assert layer32.scales.dtype == torch.float32
    p = layer.weight_packed
    assert torch.equal(p.packed, pack_w4(lin.weight.detach(), 64).packed)
    assert isinstance(layer.weight_tiled, TiledW4) and layer.weight_tiled.block_n == 64
    x = random_x(6, 128, torch.float16).reshape(2, 3, 128)
    y = layer(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.float16
    x2 = x.reshape(6, 128)
    ref = (x2.float() @ dequantize_w4(p).T + layer.bias.float()).half()
    # the kernel's bound, then the bias add in fp16 (one more rounding: within one more ulp of y)
    from ffnquant.kernels.w4a16_repack import ulp

    bound = matmul_error_bound(x2, p, ref, torch.float16) + ulp(ref.float(), torch.float16)
    assert_within(y.reshape(6, 40), ref, bound)
    assert "tiles=64x64" in repr(layer) and "symmetric" in repr(layer)
    with pytest.raises(FFNQuantError, match="nn.Linear"):
        TiledW4A16Linear(torch.nn.Conv1d(4, 4, 1), group_size=32)


def test_asym_linear(interpret):
    torch.manual_seed(1)
    lin = torch.nn.Linear(128, 40, bias=False)
    with torch.no_grad():
        lin.weight += 0.05  # a shifted weight: zero points away from 8
    layer = TiledW4A16Linear(lin, group_size=32, symmetric=False).to(dtype=torch.bfloat16)
    # .to(dtype) leaves the uint8 zero points and the scales as they are
    assert layer.zero_points.dtype == torch.uint8 and layer.scales.dtype == torch.float16
    assert "asymmetric" in repr(layer) and layer.weight_tiled.zero_points is layer.zero_points
    p = layer.weight_packed
    want = pack_w4(lin.weight.detach(), 32, symmetric=False)
    assert torch.equal(p.packed, want.packed) and torch.equal(p.zero_points, want.zero_points)
    x = random_x(3, 128, torch.bfloat16)
    ref = w4a16_reference(x, p)
    assert_within(layer(x), ref, matmul_error_bound(x, p, ref, torch.bfloat16))


# --- the device benchmark's dry run ------------------------------------------------------


@pytest.mark.parametrize("asym", [False, True], ids=["sym", "asym"])
def test_benchmark_dry_run(interpret, tmp_path, asym):
    spec = importlib.util.spec_from_file_location("w4a16_kernels_bench", ROOT / "benchmarks" / "w4a16_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run", "--d-model", "64", "--d-ff", "128", "--group", "32", "--tokens", "1,4",
                       "--out", str(tmp_path), *(["--asym"] if asym else [])]) == 0
    doc = json.loads((tmp_path / "w4a16_kernels.json").read_text())
    rows = doc["rows"]
    kernels = ("fp16", "w4a16_tiled") if asym else ("fp16", "w4a16", "w4a16_tiled")  # the old kernel: symmetric only
    assert {(r["projection"], r["m"], r["kernel"]) for r in rows} == {
        (p, m, k) for p in ("gate_up", "down") for m in (1, 4) for k in kernels}
    assert doc["settings"]["asym"] is asym
    for r in rows:
        assert r["time_us"] is None and r["speedup_vs_fp16"] is None  # nothing timed in a dry run
        if r["kernel"] == "fp16":
            assert r["check"].startswith("n/a")
        else:
            assert r["check"] == "ok" and r["worst_excess"] <= 0 and r["config"]["path"] in ("dot", "gemv")
    assert doc["settings"]["dry_run"] and "triton" in doc["environment"]
    assert "| gate_up | 1 | w4a16_tiled |" in (tmp_path / "w4a16_kernels.md").read_text()


def test_benchmark_without_cuda_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = importlib.util.spec_from_file_location("w4a16_kernels_bench", ROOT / "benchmarks" / "w4a16_kernels.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no CUDA device" in err and "\n" not in err


# --- compiled mode without a GPU: the kernels compile for sm_90 (Triton's compiler and ptxas run on a CPU) --------


def _compile_sm90(kernel: str, xdt: str, atomic: bool, gated: bool, **const):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ffnquant.kernels import w4a16_tiled as tiled

    tiled._triton()
    fn = getattr(tiled._kernels(False), kernel)
    ints = ("M", "N", "NPAD", "KT", "stride_xm", "stride_om", "iters_per_split")
    sdt = "fp16"
    types = {"x_ptr": f"*{xdt}", "w_ptr": "*i32", "s_ptr": f"*{sdt}", "w2_ptr": "*i32", "s2_ptr": f"*{sdt}",
             "z_ptr": "*u8", "z2_ptr": "*u8", "o_ptr": "*fp32" if atomic else f"*{xdt}", **dict.fromkeys(ints, "i32")}
    consts = {"GROUP": 128, "BLOCK_K": 128, "LAYOUT_N": 64, "XKIND": {"fp32": 0, "fp16": 1, "bf16": 2}[xdt],
              "ATOMIC": atomic, "GATED": gated, "ACT": 0 if gated else 5, "ASYM": False, **const}
    if kernel == "dot":
        consts["DOT_DT"] = {"fp32": tiled.tl.float32, "fp16": tiled.tl.float16, "bf16": tiled.tl.bfloat16}[xdt]
    aligned = ("x_ptr", "w_ptr", "s_ptr", "w2_ptr", "s2_ptr", "o_ptr", "NPAD", "stride_xm", "stride_om")
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    warps, stages = consts.pop("num_warps", 4), consts.pop("num_stages", 3)
    sig = {a: "constexpr" if a in consts else types[a] for a in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_compile_for_sm90(monkeypatch):
    """The interpreter never runs Triton's compiler: compile the kernel variants the tuner uses for an H100/H200
    (sm_90) on this CPU, so compiled-mode errors show without a GPU. Cubins are produced, not run."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
    variants = [
        ("dot", "fp16", False, False, {"BLOCK_M": 16, "BLOCK_N": 64}),
        ("dot", "bf16", True, False, {"BLOCK_M": 16, "BLOCK_N": 32, "num_stages": 4}),
        ("dot", "fp32", False, False, {"BLOCK_M": 16, "BLOCK_N": 64}),
        ("dot", "fp16", False, True, {"BLOCK_M": 64, "BLOCK_N": 128}),
        ("gemv", "fp16", True, False, {"BLOCK_N": 64, "num_stages": 1}),
        ("gemv", "bf16", False, True, {"BLOCK_N": 32, "num_stages": 1}),
        # asymmetric groups (zero points): the same kernels with ASYM on
        ("dot", "fp16", False, False, {"BLOCK_M": 16, "BLOCK_N": 64, "ASYM": True}),
        ("dot", "bf16", True, True, {"BLOCK_M": 64, "BLOCK_N": 128, "ASYM": True}),
        ("gemv", "fp16", True, True, {"BLOCK_N": 64, "num_stages": 1, "ASYM": True}),
    ]
    loads = {}
    for kernel, xdt, atomic, gated, const in variants:
        try:
            compiled = _compile_sm90(kernel, xdt, atomic, gated, **const)
        except (ImportError, AttributeError, FileNotFoundError) as exc:  # another triton API, or no ptxas here
            pytest.skip(f"cannot compile for sm_90 here: {type(exc).__name__}: {exc}")
        assert compiled.asm.get("cubin"), (kernel, xdt)
        assert compiled.metadata.shared <= 227 * 1024, (kernel, xdt, compiled.metadata.shared)  # sm_90's limit
        if kernel == "dot" and xdt == "fp16" and not gated:
            ptx = compiled.asm["ptx"]
            # the design's claims, checked on the generated code: the codes arrive by cp.async (pipelined), the
            # fp16 conversion is packed (two codes per instruction), and the products run on tensor cores
            assert "cp.async" in ptx and "add.f16x2" in ptx and "mma.sync" in ptx
            loads[const.get("ASYM", False)] = compiled.asm["ttir"].count("tt.load")
    # the symmetric kernel reads no zero points: ASYM adds exactly the zero point row's two loads (before and
    # inside the loop, like the scale row's)
    assert loads[True] == loads[False] + 2, loads


# --- CUDA (skipped without a GPU) --------------------------------------------------------


@pytest.fixture
def cuda(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("m", [1, 4, 16, 64, 100], ids=lambda m: f"m{m}")
def test_cuda_matches_reference(cuda, m, dtype):
    k, n = 4096, 1000
    p = _packed(n, k, 128).to("cuda")
    t = repack_w4(p.to("cpu")).to("cuda")
    x = random_x(m, k, dtype).cuda()
    _check(x, p, t, u=2.0**-23)  # tuned config
    assert tiled_config_used(x, t) is not None
    if dtype == torch.float16:  # every candidate once (each is a compile): fp16 only
        for cfg in _candidates(m, t, gated=False):
            _check(x, p, t, cfg, u=2.0**-23)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "gelu", "relu"])
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"m{m}")
def test_cuda_gated_matches_reference(cuda, m, act):
    k, n = 2048, 1000
    pg, pu = _packed(n, k, 64, seed=6).to("cuda"), _packed(n, k, 64, seed=7).to("cuda")
    tg, tu = repack_w4(pg.to("cpu")).to("cuda"), repack_w4(pu.to("cpu")).to("cuda")
    x = random_x(m, k, torch.float16).cuda()
    ref = w4a16_gated_reference(x, pg, pu, act)
    assert_within(tiled_gated(x, tg, tu, act), ref, gated_error_bound(x, pg, pu, act, ref, torch.float16, 2.0**-23))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_asym_matches_reference(cuda, dtype):
    # forced configs (each a compile) on both paths, split K on and off, and the tuner once: a few compiles only
    k, n = 4096, 1000
    p = _packed(n, k, 128, seed=13, symmetric=False)
    t = repack_w4(p).to("cuda")
    p = p.to("cuda")
    cases = [(1, TiledConfig("gemv", 1, 64, split_k=4)), (1, TiledConfig("dot", 16, 64)),
             (16, TiledConfig("dot", 16, 64, split_k=2)), (100, TiledConfig("dot", 64, 128, 1, 8, 3))]
    for m, cfg in cases:
        _check(random_x(m, k, dtype).cuda(), p, t, cfg, u=2.0**-23)
    if dtype == torch.float16:
        x = random_x(16, k, dtype).cuda()
        _check(x, p, t, u=2.0**-23)  # tuned
        assert tiled_config_used(x, t) is not None


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16], ids=lambda m: f"m{m}")
def test_cuda_asym_gated_matches_reference(cuda, m):
    k, n = 2048, 1000
    pg, pu = _packed(n, k, 64, seed=14, symmetric=False), _packed(n, k, 64, seed=15, symmetric=False)
    tg, tu = repack_w4(pg).to("cuda"), repack_w4(pu).to("cuda")
    pg, pu = pg.to("cuda"), pu.to("cuda")
    x = random_x(m, k, torch.float16).cuda()
    ref = w4a16_gated_reference(x, pg, pu, "silu")
    assert_within(tiled_gated(x, tg, tu, "silu"), ref, gated_error_bound(x, pg, pu, "silu", ref, torch.float16, 2.0**-23))
