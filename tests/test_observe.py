"""Observers: hand-derived tiny cases, exact histogram merging, bounded state, range ordering."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ffnquant import FFNSpec, build
from ffnquant.data import TokenSource
from ffnquant.errors import FFNQuantError
from ffnquant.numerics.histogram import StreamingHistogram
from ffnquant.numerics.observe import RangeTable, TensorObserver, profile, profile_spec, weight_stats

# ------------------------------------------------------------------------------------
# StreamingHistogram
# ------------------------------------------------------------------------------------


def test_histogram_hand_case():
    # absmax 3 -> R = 4 (smallest power of two above 3); 8 bins of width 1 over [-4, 4).
    h = StreamingHistogram(8).update(torch.tensor([-3.0, -0.5, 0.0, 0.0, 1.0, 2.5]))
    assert h.range_max == 4.0
    np.testing.assert_array_equal(h.edges, [-4, -3, -2, -1, 0, 1, 2, 3, 4])
    np.testing.assert_array_equal(h.counts, [0, 1, 0, 1, 2, 1, 1, 0])
    assert h.total == 6


def test_histogram_value_at_power_of_two_widens():
    # 4.0 itself must lie strictly inside, so R becomes 8 and the bins are 2 wide.
    h = StreamingHistogram(8).update(np.array([4.0, -4.0], dtype=np.float32))
    assert h.range_max == 8.0
    np.testing.assert_array_equal(h.counts, [0, 0, 1, 0, 0, 0, 1, 0])


def test_histogram_widening_folds_pairs():
    h = StreamingHistogram(8).update(torch.tensor([-3.0, -0.5, 1.0, 2.5]))  # R = 4
    h.update(torch.tensor([7.0]))  # R = 8: bins 2 wide over [-8, 8)
    np.testing.assert_array_equal(h.edges, np.arange(-8, 9, 2))
    np.testing.assert_array_equal(h.counts, [0, 0, 1, 1, 1, 1, 0, 1])


@pytest.mark.parametrize("n_bins", [8, 64, 2048], ids=lambda n: f"bins{n}")
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"seed{s}")
def test_histogram_merge_equals_concatenation(n_bins, seed):
    gen = torch.Generator().manual_seed(seed)
    # Parts of very different scales force widening in both streaming and merging.
    parts = [torch.randn(500, generator=gen) * s for s in (0.01, 1.0, 37.0, 0.2)]
    parts.append(torch.zeros(10))
    whole = StreamingHistogram(n_bins).update(torch.cat(parts))
    streamed = StreamingHistogram(n_bins)
    for p in parts:
        streamed.update(p)
    a = StreamingHistogram(n_bins)
    for p in parts[:2]:
        a.update(p)
    b = StreamingHistogram(n_bins)
    for p in parts[2:]:
        b.update(p)
    merged = a.merge(b)
    for h in (streamed, merged, b.merge(a)):
        assert h == whole
        np.testing.assert_array_equal(h.edges, whole.edges)
    assert a.total == 1000  # merge is pure


def test_histogram_merge_with_empty_and_zeros():
    zeros = StreamingHistogram(16).update(torch.zeros(5))
    small = StreamingHistogram(16).update(torch.tensor([0.001, -0.002]))
    empty = StreamingHistogram(16)
    both = StreamingHistogram(16).update(torch.tensor([0.0] * 5 + [0.001, -0.002]))
    assert zeros.merge(small) == both
    assert empty.merge(both) == both and both.merge(empty) == both


def test_histogram_abs_quantile_within_one_bin():
    x = torch.randn(20000, generator=torch.Generator().manual_seed(3))
    h = StreamingHistogram(256).update(x)
    for q in (0.5, 0.9, 0.99, 0.999):
        exact = float(torch.quantile(x.abs(), q))
        assert abs(h.abs_quantile(q) - exact) <= h.bin_width


def test_histogram_round_trip_and_errors():
    h = StreamingHistogram(32).update(torch.randn(100))
    again = StreamingHistogram.from_dict(json.loads(json.dumps(h.to_dict())))
    assert again == h
    with pytest.raises(FFNQuantError, match="multiple of 4"):
        StreamingHistogram(10)
    with pytest.raises(FFNQuantError, match="same number of bins"):
        h.merge(StreamingHistogram(64))
    with pytest.raises(FFNQuantError, match="1 NaN"):
        StreamingHistogram(8).update(torch.tensor([1.0, float("nan")]))


# ------------------------------------------------------------------------------------
# TensorObserver
# ------------------------------------------------------------------------------------


def test_observer_hand_case():
    # Channels: c0 = [1, 0, -3], c1 = [0, 0, 0] (dead), c2 = [2, 4, 0].
    x = torch.tensor([[1.0, 0.0, 2.0], [0.0, 0.0, 4.0], [-3.0, 0.0, 0.0]])
    o = TensorObserver(16).update(x)
    vals = np.array([1, 0, 2, 0, 0, 4, -3, 0, 0], dtype=np.float64)
    mean = vals.mean()  # 4/9
    m2 = ((vals - mean) ** 2).mean()
    m4 = ((vals - mean) ** 4).mean()
    assert o.n == 9 and o.n_rows == 3 and o.channels == 3
    assert (o.min, o.max, o.absmax) == (-3.0, 4.0, 4.0)
    # Deviations are formed in float32 (unit roundoff 6e-8) before float64 accumulation.
    tol = 1e-6
    assert o.mean == pytest.approx(4 / 9, rel=tol)
    assert o.std == pytest.approx(math.sqrt(m2), rel=tol)
    assert o.kurtosis == pytest.approx(m4 / m2**2, rel=tol)
    assert o.excess_kurtosis == pytest.approx(m4 / m2**2 - 3, rel=tol)
    assert o.crest_factor == pytest.approx(4.0 / math.sqrt(m2), rel=tol)
    assert o.zero_count == 5 and o.zero_fraction == pytest.approx(5 / 9)
    np.testing.assert_array_equal(o.channel_absmax, [3.0, 0.0, 4.0])
    np.testing.assert_array_equal(o.channel_min, [-3.0, 0.0, 0.0])
    np.testing.assert_array_equal(o.channel_max, [1.0, 0.0, 4.0])
    np.testing.assert_array_equal(o.channel_ever_nonzero, [True, False, True])
    assert o.dead_units == 1
    # median channel absmax is 3: only channels above k*3 count.
    assert o.outlier_channels(1.0) == 1 and o.outlier_channels(2.0) == 0


def test_observer_percentiles_hand_case():
    # |x| = 0..99 once each: the 99th percentile of |x| is ~98-99, within one bin width.
    x = torch.arange(100, dtype=torch.float32).reshape(100, 1)
    o = TensorObserver(2048).update(x)
    width = o.histogram.bin_width  # R = 128, width 0.125
    assert o.abs_percentile(99) == pytest.approx(99.0, abs=1 + width)
    assert o.percentiles["99.99"] <= o.absmax == 99.0
    assert set(o.percentiles) == {"99", "99.9", "99.99"}


def test_observer_constant_and_empty():
    const = TensorObserver(8).update(torch.full((4, 2), 2.0))
    assert const.std == 0.0 and math.isnan(const.kurtosis) and math.isnan(const.crest_factor)
    s = const.summary()
    assert s["kurtosis"] is None and s["crest_factor"] is None
    json.dumps(s, allow_nan=False)
    empty = TensorObserver(8)
    assert empty.n == 0 and empty.dead_units == 0
    json.dumps(empty.summary(), allow_nan=False)


def test_dead_units_across_batches():
    # Unit 0 is non-zero only in the second batch: alive. Unit 1 never: dead.
    o = TensorObserver(8)
    o.update(torch.tensor([[0.0, 0.0, 1.0]]))
    o.update(torch.tensor([[-2.0, 0.0, 0.0]]))
    np.testing.assert_array_equal(o.channel_ever_nonzero, [True, False, True])
    assert o.dead_units == 1 and o.zero_count == 4


@pytest.mark.parametrize("split", [1, 7, 500, 999], ids=lambda s: f"split{s}")
def test_observer_streaming_and_merge_match_one_shot(split):
    gen = torch.Generator().manual_seed(11)
    # A shifted, skewed tensor: mean far from zero tests the moment-shift formulas.
    x = torch.randn(1000, 8, generator=gen).exp() * 3 + 100.0
    whole = TensorObserver(64).update(x)
    a = TensorObserver(64).update(x[:split])
    b = TensorObserver(64).update(x[split:])
    merged = a.merge(b)
    ref = x.double().flatten()
    mu = ref.mean()
    m2 = ((ref - mu) ** 2).mean()
    kurt = float(((ref - mu) ** 4).mean() / m2**2)
    for o in (whole, merged):
        # float32 deviations about a float32 centre near 100: ~1e-7 relative per value.
        assert o.mean == pytest.approx(float(mu), rel=1e-6)
        assert o.std == pytest.approx(float(m2.sqrt()), rel=1e-6)
        assert o.kurtosis == pytest.approx(kurt, rel=1e-5)
        assert o.skewness == pytest.approx(float(((ref - mu) ** 3).mean() / m2**1.5), rel=1e-5)
    assert merged.histogram == whole.histogram
    np.testing.assert_array_equal(merged.channel_absmax, whole.channel_absmax)
    assert merged.n == whole.n == 8000 and a.n == split * 8  # merge is pure


def test_observer_state_is_bounded():
    o = TensorObserver(256)
    x = torch.randn(1000, 64)
    o.update(x)
    size = o.nbytes()
    for _ in range(20):
        o.update(x * 1.5)
    assert o.nbytes() == size == 256 * 8 + 64 * 4 * 2 + 64
    assert len(json.dumps(o.to_dict())) < 20000  # state, not data (21,000 tokens seen)


def test_observer_errors_and_round_trip():
    o = TensorObserver(16, "hidden").update(torch.randn(10, 4))
    with pytest.raises(FFNQuantError, match="hidden: got 5 channels, expected 4"):
        o.update(torch.randn(3, 5))
    bad = torch.randn(10, 4)
    bad[0, 0] = float("nan")
    bad[1, 1] = float("inf")
    bad[2, 2] = float("-inf")
    with pytest.raises(FFNQuantError, match="hidden has 1 NaN and 2 Inf"):
        o.update(bad)
    assert o.n == 40  # a failed update changes nothing
    again = TensorObserver.from_dict(json.loads(json.dumps(o.to_dict())))
    assert again.summary() == o.summary()


def test_a_large_batch_is_observed_a_row_chunk_at_a_time(monkeypatch):
    """update() takes a batch `_CHUNK` elements of rows at a time (bounded scratch memory): exact histogram,
    extremes and counts, moments as when merged; a bad chunk anywhere changes nothing."""
    from ffnquant.numerics import observe

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1000, 8, generator=gen).exp() * 3 + 100.0
    x[5, 2] = 0.0
    whole = TensorObserver(64).update(x)
    monkeypatch.setattr(observe, "_CHUNK", 7 * 8)  # 7 rows a chunk: 143 chunks, the last one short
    chunked = TensorObserver(64).update(x)
    assert chunked.histogram == whole.histogram
    counts = (chunked.n, chunked.n_rows, chunked.zero_count)
    assert counts == (whole.n, whole.n_rows, whole.zero_count) == (8000, 1000, 1)
    for a, b in ((chunked.channel_min, whole.channel_min), (chunked.channel_max, whole.channel_max)):
        np.testing.assert_array_equal(a, b)
    for stat in ("mean", "std", "skewness", "kurtosis"):
        assert getattr(chunked, stat) == pytest.approx(getattr(whole, stat), rel=1e-6), stat
    bad = x.clone()
    bad[-1, 0] = float("nan")
    with pytest.raises(FFNQuantError, match="1 NaN"):
        chunked.update(bad)
    with pytest.raises(FFNQuantError, match="got 4 channels, expected 8"):
        chunked.update(torch.zeros(100, 4))
    assert chunked.n == 8000 and chunked.histogram == whole.histogram
    w = torch.randn(30, 20, generator=gen)
    st = weight_stats(w, bins=16)
    monkeypatch.setattr(observe, "_CHUNK", 3 * 20)
    chunked_st = weight_stats(w, bins=16)
    assert chunked_st["in_channel_absmax"] == st["in_channel_absmax"] == w.abs().amax(dim=0).double().tolist()
    assert chunked_st["channel_absmax"] == st["channel_absmax"]
    assert chunked_st["kurtosis"] == pytest.approx(st["kurtosis"], rel=1e-6)


def test_weight_stats_per_channel():
    w = torch.tensor([[1.0, -2.0], [0.5, 0.25], [0.0, 3.0]])  # [out=3, in=2]
    st = weight_stats(w, bins=16)
    assert st["shape"] == [3, 2] and st["absmax"] == 3.0
    assert st["channel_absmax"] == [2.0, 0.5, 3.0]
    assert st["in_channel_absmax"] == [1.0, 3.0]


# ------------------------------------------------------------------------------------
# profile / RangeTable
# ------------------------------------------------------------------------------------


def _small(variant: str) -> FFNSpec:
    return FFNSpec(variant, d_model=32)


def test_profile_sites_hooks_removed_and_no_change():
    model = build(_small("swiglu"), seed=0)
    x = torch.randn(4, 5, 32)
    with torch.no_grad():
        ref = model(x)
    table = profile(model, [x, x[:1]])
    assert set(table.sites) == set(model.spec.sites) and table.n_tokens == 25
    assert all(len(t._forward_hooks) == 0 for t in model.taps.values())
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=0, atol=0)
    # The observers saw what the module computed.
    with torch.no_grad():
        h = torch.nn.functional.silu(model.w_gate(x)) * model.w_up(x)
    assert table["hidden"].absmax == pytest.approx(float(h.abs().max()), rel=1e-6)
    assert table["output"].absmax == pytest.approx(float(ref.abs().max()), rel=1e-6)
    assert set(table.weights) == {"w_up", "w_gate", "w_down"}


def test_profile_removes_hooks_on_error():
    model = build(_small("relu"), seed=0)
    bad = torch.randn(2, 32)
    bad[0, 3] = float("nan")
    with pytest.raises(FFNQuantError, match="input has 1 NaN"):
        profile(model, [torch.randn(2, 32), bad])
    assert all(len(t._forward_hooks) == 0 for t in model.taps.values())
    with pytest.raises(FFNQuantError, match=r"expected \(\.\.\., 32\)"):
        profile(model, [torch.randn(2, 31)])
    with pytest.raises(FFNQuantError, match="unknown site for relu 'gate_pre'"):
        profile(model, [torch.randn(2, 32)], sites=["gate_pre"])


def test_dense_act_and_hidden_agree():
    # In a dense FFN `act` and `hidden` are the same tensor; the shared batch path must agree.
    table = profile(build(_small("relu"), seed=1), [torch.randn(64, 32)])
    assert table["act"].summary() == {**table["hidden"].summary()}
    assert table["act"] is not table["hidden"]


def test_relu_zeros_and_dead_units_counted_exactly():
    model = build(FFNSpec("relu", d_model=32, d_ff=8, bias=True), seed=0)
    with torch.no_grad():
        model.w_up.bias[:3] = -100.0  # these units can never fire on N(0,1) inputs
    x = torch.randn(200, 32, generator=torch.Generator().manual_seed(0))
    table = profile(model, [x])
    with torch.no_grad():
        act = torch.relu(model.w_up(x))
    assert table["hidden"].zero_count == int((act == 0).sum())
    assert table["hidden"].dead_units == int((act == 0).all(dim=0).sum()) >= 3


def test_range_table_merge_and_round_trip():
    spec = _small("geglu")
    src = TokenSource("gaussian", seed=5)
    whole = profile_spec(spec, src, 600, batch_size=200, bins=64)
    x = src.tokens(600, 32)
    model = build(spec)
    a, b = profile(model, [x[:250]], bins=64), profile(model, [x[250:]], bins=64)
    merged = a.merge(b)
    assert merged.n_tokens == 600
    for s in spec.sites:
        assert merged[s].histogram == whole[s].histogram
        assert merged[s].kurtosis == pytest.approx(whole[s].kurtosis, rel=1e-6)
    again = RangeTable.from_dict(json.loads(json.dumps(whole.to_dict())))
    assert again.summary() == whole.summary() and again.spec == spec
    with pytest.raises(FFNQuantError, match="different FFNs"):
        a.merge(profile(build(_small("relu")), [x[:10]], bins=64))
    with pytest.raises(FFNQuantError, match="unknown site 'nope'"):
        whole["nope"]


def test_hidden_range_ordering_on_gaussian_inputs():
    """The measured ordering the README reports: relu/gelu `hidden` narrower than the gated
    swiglu/geglu/reglu, by crest factor and kurtosis (d=128, 4096 tokens, fixed seeds)."""
    src = TokenSource("gaussian", seed=0)
    tables = {v: profile_spec(FFNSpec(v, d_model=128), src, 4096, bins=256) for v in ("relu", "gelu", "swiglu", "geglu", "reglu")}
    crest = {v: t["hidden"].crest_factor for v, t in tables.items()}
    kurt = {v: t["hidden"].kurtosis for v, t in tables.items()}
    assert max(crest["relu"], crest["gelu"]) < min(crest["swiglu"], crest["geglu"], crest["reglu"]), crest
    assert max(kurt["relu"], kurt["gelu"]) < min(kurt["swiglu"], kurt["geglu"], kurt["reglu"]), kurt
    # ReLU zeroes about half its units on symmetric inputs (bias is small), GELU none exactly.
    assert 0.4 < tables["relu"]["hidden"].zero_fraction < 0.6
    assert tables["gelu"]["hidden"].zero_fraction == 0.0
