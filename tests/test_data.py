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


# --- token files: byte order, dtypes, special files, permissions, sizes ------------------------------


def _one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, FFNQuantError)
    return message


@pytest.mark.parametrize("dtype", [">f2", ">f4", ">f8", "<f2", "<f8"], ids=str)
def test_npy_of_either_byte_order_loads_as_native_float32(tmp_path, dtype):
    x = np.random.default_rng(0).standard_normal((6, 4))
    np.save(tmp_path / "t.npy", x.astype(dtype))
    got = load_tokens(tmp_path / "t.npy", d_model=4)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), x.astype(dtype).astype(np.float32))


def test_npy_format_version_3_loads(tmp_path):
    x = np.ones((3, 4), np.float32)
    with open(tmp_path / "t.npy", "wb") as fh:
        np.lib.format.write_array(fh, x, version=(3, 0))
    assert load_tokens(tmp_path / "t.npy", d_model=4).shape == (3, 4)


_NPY_REFUSED = [
    pytest.param(np.complex64, "complex64", id="complex"),
    pytest.param(object, "object", id="object"),
    pytest.param(np.int64, "int64", id="int"),
    pytest.param(np.uint8, "uint8", id="uint8"),
    pytest.param(bool, "bool", id="bool"),
    pytest.param("U3", "str96", id="unicode-strings"),
    pytest.param("S3", "bytes24", id="byte-strings"),
    pytest.param("M8[s]", r"datetime64\[s\]", id="datetime"),
    pytest.param("f4,f4", "void64", id="structured"),
]
if np.dtype(np.longdouble).itemsize > 8:  # float128 (x86) or float96; on some platforms longdouble is float64
    _NPY_REFUSED.append(pytest.param(np.longdouble, np.dtype(np.longdouble).name, id="longdouble"))


@pytest.mark.parametrize("dtype, name", _NPY_REFUSED)
def test_npy_unsupported_dtypes_are_refused_with_the_supported_list(tmp_path, dtype, name):
    np.save(tmp_path / "t.npy", np.zeros((3, 4), dtype=dtype), allow_pickle=True)
    with pytest.raises(FFNQuantError) as info:
        load_tokens(tmp_path / "t.npy", d_model=4)
    assert _one_line(info).endswith(f"has dtype {name.replace(chr(92), '')}; expected floating-point values, one of: "
                                    "float16, float32, float64")


@pytest.mark.parametrize(
    "dtype, accepted",
    [
        pytest.param(torch.bfloat16, True, id="bfloat16"),
        pytest.param(torch.float64, True, id="float64"),
        pytest.param(torch.float8_e4m3fn, True, id="float8_e4m3"),
        pytest.param(torch.int32, False, id="int32"),
        pytest.param(torch.bool, False, id="bool"),
        pytest.param(torch.uint8, False, id="uint8"),
        pytest.param(torch.complex64, False, id="complex64"),
    ],
)
def test_safetensors_dtypes(tmp_path, dtype, accepted):
    path = tmp_path / "t.safetensors"
    save_file({"acts": torch.ones(3, 4).to(dtype)}, str(path))
    if accepted:
        assert torch.equal(load_tokens(path, d_model=4), torch.ones(3, 4))
        return
    with pytest.raises(FFNQuantError) as info:
        load_tokens(path, d_model=4)
    assert "expected floating-point values, one of: float16, bfloat16, float32, float64" in _one_line(info)


def test_truncated_npy_is_named(tmp_path):
    np.save(tmp_path / "t.npy", np.ones((6, 4), np.float32))
    data = (tmp_path / "t.npy").read_bytes()
    (tmp_path / "t.npy").write_bytes(data[:-8])
    with pytest.raises(FFNQuantError) as info:
        load_tokens(tmp_path / "t.npy", d_model=4)
    assert "is truncated: its header says float32 (6, 4) (96 bytes of data) but 88 bytes follow it" in _one_line(info)


def test_special_and_unreadable_token_files(tmp_path, monkeypatch):
    import builtins
    import os

    os.mkfifo(tmp_path / "fifo.npy")  # np.load would block on it forever
    with pytest.raises(FFNQuantError) as info:
        load_tokens(tmp_path / "fifo.npy", d_model=4)
    assert _one_line(info).endswith("fifo.npy' is a FIFO, not a regular file")
    (tmp_path / "dir.npy").mkdir()
    with pytest.raises(FFNQuantError, match="is a folder, not a regular file"):
        load_tokens(tmp_path / "dir.npy")

    # Tests run as root, where mode 000 still reads: deny the open itself instead.
    for name in ("t.npy", "t.safetensors"):
        path = tmp_path / name
        np.save(path, np.ones((2, 4), np.float32)) if name.endswith(".npy") else save_file({"a": torch.ones(2, 4)}, str(path))
        real_open = builtins.open

        def denied(file, *args, _path=str(path), **kwargs):
            if str(file) == _path:
                raise PermissionError(13, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", denied)
        with pytest.raises(FFNQuantError) as info:
            load_tokens(path, d_model=4)
        monkeypatch.setattr(builtins, "open", real_open)
        assert _one_line(info) == f"cannot read token file {str(path)!r}: permission denied"


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root reads files of mode 000; the denied open is tested above by patching open")
def test_mode_000_token_file_is_refused(tmp_path):
    np.save(tmp_path / "t.npy", np.ones((2, 4), np.float32))
    (tmp_path / "t.npy").chmod(0)
    with pytest.raises(FFNQuantError, match="permission denied"):
        load_tokens(tmp_path / "t.npy", d_model=4)


@pytest.fixture
def memory_8gb(monkeypatch):
    from ffnquant.infra import resources

    monkeypatch.setattr(resources, "available_memory", lambda: 8 * 10**9)


@pytest.mark.parametrize(
    "make, message",
    [
        pytest.param(lambda: TokenSource("gaussian").tokens(2, 10**9),
                     "drawing 2 tokens at d_model 1000000000 (in chunks of 1024) needs 4.1 TB; this machine has "
                     "8.0 GB available: choose a smaller d_model or fewer tokens", id="gaussian-huge-d"),
        pytest.param(lambda: TokenSource("llm_like").tokens(2, 10**9), "drawing 2 tokens at d_model 1000000000",
                     id="llm_like-huge-d"),
        pytest.param(lambda: gaussian_tokens(10**6, 4096), "drawing 1000000 tokens at d_model 4096", id="many-tokens"),
        pytest.param(lambda: outlier_channel_indices(2 * 10**9, 0, 4), "the outlier-channel layout at d_model",
                     id="outlier-layout"),
    ],
)
def test_synthetic_tokens_that_cannot_fit_are_refused_before_drawing(memory_8gb, make, message):
    with pytest.raises(FFNQuantError) as info:
        make()
    assert message in _one_line(info)


def test_token_file_too_big_for_memory_is_refused_from_its_header(memory_8gb, tmp_path):
    # a header promising 10**9 x 10**4 float32 values: refused before numpy tries to read them
    with open(tmp_path / "huge.npy", "wb") as fh:
        np.lib.format.write_array_header_1_0(fh, {"descr": "<f4", "fortran_order": False, "shape": (10**9, 10**4)})
    with pytest.raises(FFNQuantError) as info:
        load_tokens(tmp_path / "huge.npy", d_model=10**4)
    assert "float32 (1000000000, 10000), needs 140.0 TB to load; this machine has 8.0 GB" in _one_line(info)


@pytest.mark.parametrize("dtype, name", [pytest.param(np.complex64, "complex64", id="complex"),
                                         pytest.param(np.int32, "int32", id="int")])
def test_cli_refuses_unsupported_token_dtype_with_exit_2(tmp_path, capsys, dtype, name):
    from ffnquant.cli import main

    np.save(tmp_path / "t.npy", np.zeros((64, 16), dtype=dtype))
    argv = ["profile", "--variants", "relu", "--d-model", "16", "--tokens", "32", "--source", str(tmp_path / "t.npy"),
            "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert f"has dtype {name}; expected floating-point values, one of: float16, float32, float64" in err
    assert "\n" not in err and not (tmp_path / "out").exists()
