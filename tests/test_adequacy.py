"""Calibration adequacy (`ffnquant.adequacy`, `ffnquant model adequacy`): synthetic sites whose answer is known
(i.i.d. sequences converge, a maximum from one rare sequence does not, a wider held-out distribution clips more,
another domain costs SQNR), the exactness of the resampled histograms, and the command on a tiny model."""

from __future__ import annotations

import json
import math
from functools import reduce

import numpy as np
import pytest
import torch

from ffnquant.adequacy import (
    SiteSamples, clip_limits, clip_stats, default_sizes, layer_adequacy, scheme_grid, site_convergence, verdict,
)
from ffnquant.numerics.calibrate import Grid, calibrate_range, histogram_of
from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.numerics.histogram import StreamingHistogram
from ffnquant.model import build
from ffnquant.numerics.observe import TensorObserver
from ffnquant.spec import FFNSpec, Variant

from hf_models import tiny_folders

UINT8 = Grid.for_act("uint8", False)  # w8a8's activation grid
INT8_SYM = Grid.for_act("int8", True)
INT8_FLOOR_DB = 18.0  # w8a8 on a SwiGLU FFN with in-range inputs (derivation in the shift test)


def gaussian_sequences(m: int, tokens: int = 256, channels: int = 64, seed: int = 0, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(tokens, channels, generator=gen) for _ in range(m)]


# --- the resampled histograms are the histograms of the merged data ------------------------------


@pytest.mark.parametrize("indices", [[0], [2, 0], [1, 1, 3], [3, 2, 1, 0, 0]], ids=lambda i: "seq" + "-".join(map(str, i)))
def test_a_resample_histogram_equals_merging_its_sequences_histograms(indices):
    # sequences of different scales have different histogram ranges (2**exp): the resample folds them exactly
    seqs = [s * f for s, f in zip(gaussian_sequences(4, 64, 16), (1.0, 9.0, 0.1, 300.0))]
    got = SiteSamples(seqs, bins=256).histogram(indices)
    want = reduce(lambda a, b: a.merge(b), [StreamingHistogram(256).update(seqs[i]) for i in indices])
    assert np.array_equal(got.counts, want.counts) and np.array_equal(got.edges, want.edges)
    together = torch.cat([seqs[i] for i in indices])
    assert (got.lo, got.hi) == (float(together.min()), float(together.max()))  # the exact extremes, not bin edges


@pytest.mark.parametrize("calibrator", ["mse", "minmax", "percentile:99.9", "entropy"])
@pytest.mark.parametrize("grid", [UINT8, INT8_SYM], ids=["uint8", "int8-sym"])
def test_the_full_set_range_is_what_the_calibrator_gives_on_an_observer_of_all_values(calibrator, grid):
    # heavy tails (t with 2 degrees of freedom) leave most of the 512 bins empty: mse and minmax read the
    # merged empty runs, which must change nothing against the profile path (TensorObserver -> calibrate_range)
    gen = np.random.default_rng(1)
    seqs = [torch.from_numpy(gen.standard_t(2, size=(128, 32)).astype(np.float32)) for _ in range(5)]
    conv = site_convergence(seqs, calibrator, grid, sizes=[5], bootstrap=4, bins=512)
    obs = TensorObserver(512).update(torch.cat(seqs))
    lo, hi, _, _ = calibrate_range(histogram_of(obs), grid, calibrator)
    assert conv.lo == pytest.approx(lo, rel=1e-12, abs=1e-12) and conv.hi == pytest.approx(hi, rel=1e-12, abs=1e-12)
    assert conv.n_values == 5 * 128 * 32 and conv.n_sequences == 5


# --- convergence -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("m", "sizes"), [(1, [1]), (2, [1, 2]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 9])],
                         ids=lambda v: str(v))
def test_default_sizes_double_up_to_every_sequence(m, sizes):
    assert default_sizes(m) == sizes


def test_iid_gaussian_sequences_converge_from_one_sequence():
    # percentile:99 on 16,384 values per sequence: the 99th percentile's standard error is
    # sqrt(q(1-q)/N)/phi(2.326) = 0.029, 1.3% of 2.326, so the width (two sides) has a p95-p5 of about
    # 3.29 * 1.3% / sqrt(2) = 3% at n=1 (under the 5% tolerance), shrinking as 1/sqrt(n)
    m = 8
    conv = site_convergence(gaussian_sequences(m), "percentile:99", UINT8, bootstrap=50)
    assert conv.converged_at == 1
    assert [r.n for r in conv.rows] == [1, 2, 4, 8]
    first, last = conv.rows[0].spread, conv.rows[-1].spread
    assert first < 0.05
    # 1/sqrt(n): sqrt(8) = 2.8 between n=1 and n=8, within the bootstrap's own noise (50 resamples) of a factor 2
    assert math.sqrt(m) / 2 < first / last < math.sqrt(m) * 2
    for r in conv.rows:  # resamples of the same distribution: the median range is the full set's, within the spread
        assert abs(r.width_median - 1.0) < max(r.spread, 0.01)


def test_a_maximum_from_one_rare_sequence_needs_more_data():
    # minmax on 8 sequences, one of which holds a value 10x the others' maxima: a resample of 8 misses it with
    # probability (7/8)^8 = 34%, so the p5 resample has the Gaussian range and the p95 one the outlier's
    seqs = gaussian_sequences(8)
    seqs[3][17, 5] = 40.0
    conv = site_convergence(seqs, "minmax", UINT8, bootstrap=50)
    assert conv.converged_at is None
    assert conv.final_spread > 0.5 and conv.rows[-1].width_p5 < 0.25 and conv.rows[-1].width_p95 == 1.0
    stable, remark, text = verdict(conv, clip_stats(torch.cat(seqs), conv.lo, conv.hi),
                                   clip_stats(seqs[0], conv.lo, conv.hi))
    assert not stable and remark is None
    assert text.startswith("needs more data: the range still moves by ") and text.endswith("at 8 sequences")
    # a percentile never sees one value in 131,072: the same data is stable under it
    assert site_convergence(seqs, "percentile:99", UINT8, bootstrap=50).converged_at == 1


def test_resamples_are_seeded_and_reuse_repeated_draws():
    seqs = gaussian_sequences(4, 64, 8)
    a = site_convergence(seqs, "percentile:99.9", UINT8, bootstrap=20, seed=3)
    assert a == site_convergence(seqs, "percentile:99.9", UINT8, bootstrap=20, seed=3)
    assert a != site_convergence(seqs, "percentile:99.9", UINT8, bootstrap=20, seed=4)
    # one sequence per resample: only 4 distinct resamples exist, each calibrated once
    assert a.rows[0].n == 1 and a.rows[0].distinct <= 4 and a.rows[0].resamples == 20
    assert [r.n for r in site_convergence(seqs, "minmax", UINT8, sizes=[2], bootstrap=5).rows] == [2, 4]  # all, always


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"calibrator": "median"}, "unknown calibrator"),
    ({"calibrator": "search"}, "choose auto or one calibrator"),
    ({"bootstrap": 0}, "positive integer"),
    ({"tolerance": 0.0}, "tolerance"),
    ({"tolerance": 1.5}, "tolerance"),
    ({"sizes": [0]}, "from 1 to the 3 sequences"),
    ({"sizes": [4]}, "from 1 to the 3 sequences"),
], ids=["unknown-calibrator", "search", "bootstrap-0", "tolerance-0", "tolerance-1.5", "size-0", "size-past-all"])
def test_bad_options_are_one_line_errors(kwargs, message):
    args = {"calibrator": "mse", **kwargs}
    with pytest.raises(FFNQuantError, match=message):
        site_convergence(gaussian_sequences(3, 8, 4), grid=UINT8, **args)


def test_a_scheme_without_static_ranges_is_refused():
    assert scheme_grid("w8a8") == UINT8
    with pytest.raises(FFNQuantError, match="no static activation ranges"):
        scheme_grid("w8a8-dynamic")


# --- clipping --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("lo", "hi", "grid", "limits"), [
    (-1.0, 2.0, UINT8, (-1.0, 2.0)),
    (0.5, 2.0, UINT8, (0.0, 2.0)),  # zero is always on the grid
    (-1.0, 2.0, INT8_SYM, (-2.0, 2.0)),  # a symmetric grid mirrors the wider side
], ids=["asymmetric", "zero-included", "symmetric"])
def test_clip_limits_are_the_grid_s(lo, hi, grid, limits):
    assert clip_limits(lo, hi, grid) == limits


def test_clip_stats_count_values_tokens_and_reach():
    x = torch.tensor([[0.0, 1.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0], [0.0, -4.0, 0.0, 0.0]])
    s = clip_stats(x, -2.0, 2.0)
    assert (s.n_values, s.n_tokens) == (12, 3)
    assert s.clip_rate == 2 / 12 and s.token_clip_rate == 2 / 3
    assert s.absmax_beyond == 1.0  # -4 is twice the lower limit
    assert clip_stats(x, -4.0, 3.0).absmax_beyond == 0.0 and clip_stats(x, -4.0, 3.0).clip_rate == 0.0
    assert clip_stats(x, -4.0, 0.0).absmax_beyond is None  # positives past a limit of 0
    assert clip_stats(x, 0.0, 3.0).absmax_beyond is None and clip_stats(x, 0.0, 3.0).clip_rate == 2 / 12
    assert clip_stats(x.abs(), 0.0, 3.0).absmax_beyond == pytest.approx(1 / 3)  # nothing below a lower limit of 0


def test_held_out_values_from_a_wider_distribution_clip_more():
    # minmax on 8 x 16,384 N(0,1) values sets the limits near +-4.4; N(0,2^2) values pass them with probability
    # 2*Q(2.2) = 2.8%, while N(0,1) held-out values do with about 1/(N+1) = 8e-6, under the remark's floor
    seqs = gaussian_sequences(8)
    conv = site_convergence(seqs, "minmax", UINT8, bootstrap=10)
    ours = clip_stats(torch.cat(seqs), conv.lo, conv.hi)
    same = clip_stats(gaussian_sequences(1, seed=7)[0], conv.lo, conv.hi)
    wider = clip_stats(gaussian_sequences(1, seed=7, scale=2.0)[0], conv.lo, conv.hi)
    assert ours.clip_rate == 0.0 and same.clip_rate < 1e-4 and 0.015 < wider.clip_rate < 0.05
    assert verdict(conv, ours, same)[1] is None
    stable, remark, text = verdict(conv, ours, wider)
    assert remark is not None and "where no calibration value does" in remark and text.endswith(remark)


# --- one FFN layer ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ffn():
    return build(FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64), seed=0)


def test_layer_adequacy_reports_every_site_and_the_cost_of_another_domain(ffn):
    # text A: N(0,1) inputs; held out: the same distribution; shift text B: 4x wider. Static int8 ranges that
    # fit the data leave 6.02*8 + 4.77 - 20*log10(crest) = 23-39 dB per site for crest factors 5-30, the two
    # sites' errors adding at the output (> INT8_FLOOR_DB). A's ranges clip B's input at about 1.1 sigma_B,
    # leaving E[(|z|-c)^2; |z|>c] = 0.13 of its signal (9 dB): calibrating on A costs well over 6 dB on B
    calib = gaussian_sequences(6, 128, 32, seed=0)
    res = layer_adequacy(ffn, calib, gaussian_sequences(1, 256, 32, seed=1)[0], "w8a8", "minmax",
                         shift_tokens=gaussian_sequences(1, 256, 32, seed=2, scale=4.0)[0], bootstrap=10)
    assert set(res.sites) == {"input", "hidden"}
    assert (res.n_sequences, res.calib_tokens, res.eval_tokens, res.shift_tokens) == (6, 768, 256, 256)
    for site, a in res.sites.items():
        assert a.convergence.calibrator == "minmax" and a.calibration.clip_rate == 0.0
        assert a.shift["clip_rate_a"] > a.shift["clip_rate_b"] == 0.0
        assert a.verdict.startswith(("ranges stable from", "needs more data"))
    assert res.held_out_sqnr_db > INT8_FLOOR_DB
    assert res.shift_sqnr_b_db > INT8_FLOOR_DB and res.shift_sqnr_delta_db > 6.0
    data = json.loads(json.dumps(res.to_dict(), allow_nan=False))  # JSON-able as it is
    assert data["sites"]["input"]["convergence"]["rows"][-1]["n"] == 6


def test_layer_adequacy_without_shift_text(ffn):
    res = layer_adequacy(ffn, gaussian_sequences(2, 32, 32), gaussian_sequences(1, 32, 32, seed=1)[0], bootstrap=3)
    assert res.shift_tokens is None and res.shift_sqnr_delta_db is None
    assert all(a.shift is None for a in res.sites.values())


# --- the shipped code sample and the command -------------------------------------------------------


def test_the_code_sample_is_python_source_selectable_by_name():
    from ffnquant.hf.capture import default_text_path, text_label

    path = default_text_path("code")
    text = path.read_text(encoding="utf-8")
    assert 5_000 < len(text.encode()) < 32_000
    compile(text, str(path), "exec")  # really code: a different domain from the two books
    assert text_label(None, "code") == "code:evaluation (shipped corpus)"  # no text: the shipped code corpus
    assert "code.txt" in (path.parent / "TEXTS.md").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_folders(tmp_path_factory, ("llama",))["llama"][0]


@pytest.mark.hf
def test_model_adequacy_writes_json_and_markdown(llama, tmp_path, capsys):
    out = tmp_path / "adequacy"
    rc = main(["model", "adequacy", "--model", str(llama), "--calibrator", "percentile:99.9", "--bootstrap", "5",
               "--max-calib-tokens", "400", "--max-eval-tokens", "200", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "adequacy.json").read_text())
    md = (out / "adequacy.md").read_text()
    assert [layer["label"] for layer in data["layers"]] == ["L0", "L1"]
    assert data["texts"]["shift"]["source"] == "ffnquant/data/code.txt"
    assert data["texts"]["shift"]["tokens"]["obtained"] == 200  # --max-eval-tokens caps the shift text too
    assert data["texts"]["calibration"]["source"] == "prose:calibration (shipped corpus)"
    # max_position_embeddings 64 caps the windows: 400 tokens are 6 windows and 16 tokens, which join the last
    assert data["options"]["seq_len"] == 64 and data["texts"]["calibration"]["sequences"] == 6
    for layer in data["layers"]:
        assert (layer["n_sequences"], layer["calib_tokens"], layer["eval_tokens"]) == (6, 400, 200)
        assert layer["shift_sqnr_delta_db"] is not None
        for a in layer["sites"].values():
            conv = a["convergence"]
            assert [r["n"] for r in conv["rows"]] == [1, 2, 4, 6] and conv["bootstrap"] == 5
            assert a["verdict"].startswith(("ranges stable from", "needs more data"))
    assert data["summary"]["n_sites"] == 4
    assert md.startswith("# Calibration adequacy of ") and "ffnquant model adequacy --model" in md
    assert "| L1 | hidden |" in md and "## Summary" in md
    printed = capsys.readouterr().out
    assert "wrote " in printed and (" of 4 sites" in printed or "no site's range is stable" in printed)


@pytest.mark.hf
@pytest.mark.parametrize(("extra", "message"), [
    (["--calibrator", "median"], "unknown calibrator"),
    (["--bootstrap", "0"], "expected a positive integer"),
    (["--shift-text", "no-such-file.txt"], "no-such-file.txt"),
    (["--scheme", "w4a16-g128"], "no static activation ranges"),
], ids=["unknown-calibrator", "bootstrap-0", "missing-shift-text", "weight-only-scheme"])
def test_model_adequacy_bad_input_exits_2_with_one_line(llama, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    rc = main(["model", "adequacy", "--model", str(llama), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not (out / "adequacy.json").exists()
