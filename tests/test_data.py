"""Token sources: reproducible streaming, LLM-like outliers, file validation, disjoint calib/eval."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ffnquant.data import (
    SourceKind,
    TokenSource,
    calibration_and_eval,
    gaussian_tokens,
    llm_like_tokens,
    load_tokens,
    outlier_channel_indices,
    parse_source,
)
from ffnquant.errors import FFNQuantError


@pytest.mark.parametrize("kind", ["gaussian", "llm_like"], ids=str)
@pytest.mark.parametrize("batch_size", [7, 300, 1024, 5000], ids=lambda b: f"bs{b}")
def test_batches_equal_tokens_for_any_batch_size(kind, batch_size):
    src = TokenSource(kind, seed=7)
    whole = src.tokens(2500, 16)
    parts = list(src.batches(2500, 16, batch_size))
    assert all(p.shape[0] <= batch_size for p in parts)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=0)


def test_seeds_and_streams_differ():
    a = gaussian_tokens(100, 8, seed=0)
    assert torch.equal(a, gaussian_tokens(100, 8, seed=0))
    assert not torch.equal(a, gaussian_tokens(100, 8, seed=1))
    assert not torch.equal(a, gaussian_tokens(100, 8, seed=0, stream=1))
    assert abs(float(gaussian_tokens(20000, 8, seed=3).std()) - 1.0) < 0.02


def test_llm_like_outlier_channels():
    d, k = 64, 4
    x = llm_like_tokens(4096, d, seed=2, n_outlier_channels=k, outlier_scale=50.0)
    idx = outlier_channel_indices(d, 2, k)
    assert len(set(idx.tolist())) == k
    absmax = x.abs().amax(dim=0)
    others = absmax[[c for c in range(d) if c not in set(idx.tolist())]]
    ratio = absmax[idx] / others.median()
    assert bool((ratio > 20).all()) and bool((ratio < 100).all()), ratio
    # The layout depends on the seed only, not on the stream: eval data has the same outliers.
    y = llm_like_tokens(256, d, seed=2, stream=1)
    assert set(y.abs().amax(dim=0).topk(k).indices.tolist()) == set(idx.tolist())
    assert llm_like_tokens(10, d, seed=2, n_outlier_channels=0).abs().max() < 10


def test_source_validation():
    with pytest.raises(FFNQuantError, match="unknown token source kind 'noise'; valid: gaussian, llm_like, file"):
        TokenSource("noise")
    with pytest.raises(FFNQuantError, match="needs a path"):
        TokenSource("file")
    with pytest.raises(FFNQuantError, match="outlier_scale"):
        TokenSource("llm_like", outlier_scale=-1.0)
    with pytest.raises(FFNQuantError, match="batch_size"):
        list(TokenSource().batches(10, 4, 0))
    assert TokenSource.from_dict(TokenSource("llm_like", seed=3).to_dict()) == TokenSource("llm_like", seed=3)


def _write_npy(path, arr):
    np.save(path, arr)
    return path


@pytest.mark.parametrize("shape", [(50, 8), (5, 10, 8)], ids=["tokens_d", "batch_seq_d"])
def test_load_npy_and_safetensors(tmp_path, shape):
    arr = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    npy = _write_npy(tmp_path / "t.npy", arr)
    st = tmp_path / "t.safetensors"
    save_file({"acts": torch.from_numpy(arr).half()}, str(st))
    a = load_tokens(npy, d_model=8)
    b = load_tokens(st, d_model=8)
    assert a.shape == b.shape == (50, 8) and a.dtype == b.dtype == torch.float32
    np.testing.assert_array_equal(a.numpy(), arr.reshape(-1, 8))
    torch.testing.assert_close(b, a, atol=2e-3 * 4, rtol=1e-3)  # fp16 storage: 11-bit mantissa


def test_load_errors(tmp_path):
    good = np.ones((4, 16), dtype=np.float32)
    nan = good.copy()
    nan[0, 0] = np.nan
    nan[1, 1] = np.nan
    nan[2, 2] = np.inf
    cases = {
        "missing": (tmp_path / "nope.npy", "does not exist"),
        "nan": (_write_npy(tmp_path / "nan.npy", nan), r"2 NaN and 1 Inf values \(in 3 of 4 tokens\)"),
        "dim": (_write_npy(tmp_path / "dim.npy", good[:, :8]), "last dimension 8, expected d_model 16"),
        "empty": (_write_npy(tmp_path / "empty.npy", np.zeros((0, 16), np.float32)), "is empty"),
        "int": (_write_npy(tmp_path / "int.npy", np.ones((4, 16), np.int32)), "expected floating-point"),
        "rank": (_write_npy(tmp_path / "rank.npy", np.ones(16, np.float32)), "expected \\[tokens, d_model\\]"),
        "ext": (tmp_path / "t.txt", "unsupported extension '.txt'"),
    }
    (tmp_path / "t.txt").write_text("x")
    corrupt = tmp_path / "bad.npy"
    corrupt.write_bytes(b"not a numpy file")
    cases["unreadable_npy"] = (corrupt, "cannot read token file")
    bad_st = tmp_path / "bad.safetensors"
    bad_st.write_bytes(b"\x00\x01garbage")
    cases["unreadable_st"] = (bad_st, "cannot read token file")
    multi = tmp_path / "multi.safetensors"
    save_file({"a": torch.ones(2, 16), "b": torch.ones(2, 16)}, str(multi))
    cases["several"] = (multi, "holds 2 tensors; name one of: a, b")
    for name, (path, message) in cases.items():
        with pytest.raises(FFNQuantError, match=message) as info:
            load_tokens(path, d_model=16)
        assert str(path) in str(info.value), name
    assert load_tokens(multi, d_model=16, name="b").shape == (2, 16)
    with pytest.raises(FFNQuantError, match="unknown tensor"):
        load_tokens(multi, name="c")


def test_calibration_and_eval_synthetic_disjoint():
    calib, evaluation = calibration_and_eval(TokenSource("llm_like", seed=4), 300, 200, 32)
    c = calib.tokens(300, 32)
    assert evaluation.shape == (200, 32)
    # Independent streams: no evaluation row appears among the calibration rows.
    assert not (torch.cdist(evaluation, c) == 0).any()
    with pytest.raises(FFNQuantError, match="has 300 tokens, 301 were requested"):
        calib.tokens(301, 32)


def test_calibration_and_eval_file_rows(tmp_path):
    arr = np.arange(10 * 4, dtype=np.float32).reshape(10, 4)
    path = _write_npy(tmp_path / "rows.npy", arr)
    src = parse_source(str(path))
    calib, evaluation = calibration_and_eval(src, 6, 3, 4)
    np.testing.assert_array_equal(calib.tokens(6, 4).numpy(), arr[:6])
    np.testing.assert_array_equal(evaluation.numpy(), arr[6:9])
    np.testing.assert_array_equal(torch.cat(list(calib.batches(6, 4, 4))).numpy(), arr[:6])
    with pytest.raises(FFNQuantError, match="need 11"):
        calibration_and_eval(src, 6, 5, 4)


def test_parse_source():
    assert parse_source("gaussian", seed=3) == TokenSource(SourceKind.GAUSSIAN, seed=3)
    assert parse_source("LLM-like", n_outlier_channels=2).n_outlier_channels == 2
    assert parse_source("file:x.bin").path == "x.bin"
    s = parse_source("acts.safetensors::layer3")
    assert (s.kind, s.path, s.tensor_name) == (SourceKind.FILE, "acts.safetensors", "layer3")
    with pytest.raises(FFNQuantError, match="unknown token source 'uniform'; valid: gaussian, llm_like, file:PATH"):
        parse_source("uniform")
