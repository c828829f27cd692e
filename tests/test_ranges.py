"""Range report: findings and claims follow the numbers, files are complete, the CLI validates first."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ffnquant import FFNSpec
from ffnquant.cli import main
from ffnquant.data import TokenSource
from ffnquant.errors import FFNQuantError
from ffnquant.numerics.observe import RangeTable, TensorObserver
from ffnquant.ranges import claims, findings, profile_variants
from ffnquant.report.ranges import REPORT_FILES, SCHEMA_VERSION, range_report_markdown, write_range_report

D = 32


@pytest.fixture(scope="module")
def tables():
    specs = [FFNSpec(v, d_model=D) for v in ("relu", "gelu", "reglu", "swiglu")]
    return profile_variants(specs, TokenSource("gaussian", seed=0), 2048, batch_size=512, bins=256)


def _fake(variant: str, hidden: torch.Tensor) -> RangeTable:
    """A table whose `hidden` holds chosen values, to drive findings/claims both ways."""
    spec = FFNSpec(variant, d_model=D)
    return RangeTable(spec, {"hidden": TensorObserver(64, "hidden").update(hidden)}, {}, hidden.shape[0])


def _by_id(items):
    return {c["id"]: c for c in items}


def test_claims_follow_measurements(tables):
    c = _by_id(claims(tables))
    z = tables["relu"]["hidden"].zero_fraction
    assert c["relu_half_zero"]["status"] == ("confirmed" if 0.4 <= z <= 0.6 else "contradicted")
    assert f"{100 * z:.1f}%" in c["relu_half_zero"]["detail"]
    s, r = tables["swiglu"]["hidden"], tables["relu"]["hidden"]
    expected = "confirmed" if (s.crest_factor > r.crest_factor and s.kurtosis > r.kurtosis) else None
    if expected:
        assert c["swiglu_wider_than_relu"]["status"] == expected
    assert c["swiglu_wider_than_relu"]["figures"]["crest_factor"]["swiglu"] == s.crest_factor


def test_claims_can_be_contradicted():
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(4000, 16, generator=gen)
    # A "relu" whose hidden is never zero and wider than a Gaussian "swiglu": both claims fail.
    relu = _fake("relu", dense.abs() + 0.1 + (torch.rand(4000, 16, generator=gen) < 0.001) * 50.0)
    swiglu = _fake("swiglu", dense)
    c = _by_id(claims({"relu": relu, "swiglu": swiglu}))
    assert c["relu_half_zero"]["status"] == "contradicted"
    assert c["swiglu_wider_than_relu"]["status"] == "contradicted"
    assert c["swiglu_widest"]["status"] == "contradicted"
    only = _by_id(claims({"gelu": _fake("gelu", dense)}))
    assert only["relu_half_zero"]["status"] == "not measured"
    assert only["swiglu_widest"]["status"] == "not measured"


def test_findings_name_widest_and_sparsity(tables):
    f = _by_id(findings(tables))
    crest = {v: t["hidden"].crest_factor for v, t in tables.items()}
    widest = max(crest, key=crest.get)
    assert f["widest_hidden"]["text"].split(": ", 1)[1].startswith(widest)
    sparse = f["relu_sparsity"]["text"]
    assert "relu" in sparse and "reglu" in sparse and "gelu 0" not in sparse
    assert f["dead_units"]["figures"]["dead_units"] == {v: t["hidden"].dead_units for v, t in tables.items()}


def test_outlier_finding_on_llm_like_inputs():
    specs = [FFNSpec("relu", d_model=D)]
    t = profile_variants(specs, TokenSource("llm_like", seed=1, n_outlier_channels=3), 1024, bins=64)
    f = _by_id(findings(t))
    assert f["outlier_channels"]["figures"]["outlier_channels"]["input"]["relu"] == 3
    assert "`input` 3 in every variant" in f["outlier_channels"]["text"]


def test_write_range_report(tables, tmp_path):
    paths = write_range_report(tables, tmp_path / "out", {"n_tokens": 2048})
    assert {p.name for p in paths.values()} == set(REPORT_FILES.values())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(REPORT_FILES.values())
    data = json.loads(paths["json"].read_text())
    assert data["schema_version"] == SCHEMA_VERSION and "packages" in data["environment"]
    assert set(data["variants"]) == set(tables)
    assert data["variants"]["swiglu"]["spec"]["d_ff"] == tables["swiglu"].spec.d_ff
    assert data["variants"]["relu"]["sites"]["hidden"]["kurtosis"] == pytest.approx(tables["relu"]["hidden"].kurtosis)
    reloaded = RangeTable.from_dict(data["tables"]["swiglu"])
    assert reloaded["hidden"].histogram == tables["swiglu"]["hidden"].histogram
    assert {c["id"] for c in data["claims"]} >= {"relu_half_zero", "swiglu_wider_than_relu"}
    md = paths["markdown"].read_text()
    assert "## Findings" in md and "ranges_hidden_hist.png" in md and "**`gate_pre`**" in md
    for key in ("hidden_histogram", "crest_kurtosis"):
        assert paths[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    embedded = range_report_markdown(tables, heading_level=2)
    assert embedded.startswith("## FFN activation ranges") and "### Findings" in embedded


def test_write_range_report_validates_first(tmp_path):
    with pytest.raises(FFNQuantError, match="no range tables"):
        write_range_report({}, tmp_path / "x")
    with pytest.raises(FFNQuantError, match="holds no observations"):
        write_range_report({"relu": RangeTable(FFNSpec("relu", d_model=D))}, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    with pytest.raises(FFNQuantError, match="more than once"):
        profile_variants([FFNSpec("relu", d_model=D)] * 2, TokenSource(), 10)


def test_cli_profile_writes_report(tmp_path, capsys):
    out = tmp_path / "rep"
    rc = main(["profile", "--variants", "relu,swiglu", "--d-model", "32", "--tokens", "512",
               "--batch-size", "256", "--bins", "64", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "hidden crest/kurt" in text and "findings:" in text and "ranges.json" in text
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORT_FILES.values())


@pytest.mark.parametrize(
    "extra, message",
    [
        pytest.param(["--source", "uniform"], "unknown token source 'uniform'", id="bad_source"),
        pytest.param(["--source", "missing.npy"], "does not exist", id="missing_file"),
        pytest.param(["--bins", "10"], "multiple of 4", id="bad_bins"),
        pytest.param(["--variants", "relu,nope"], "unknown variant 'nope'", id="bad_variant"),
        pytest.param(["--source", "NANFILE"], "1 NaN and 0 Inf", id="nan_file"),
        pytest.param(["--source", "SHORTFILE"], "has 10 tokens; --tokens 512", id="short_file"),
        pytest.param(["--source", "llm_like", "--outlier-channels", "99"], "--outlier-channels", id="bad_outliers"),
    ],
)
def test_cli_profile_bad_input_exits_2_and_writes_nothing(tmp_path, capsys, extra, message):
    nan = np.ones((10, 32), np.float32)
    nan[3, 4] = np.nan
    np.save(tmp_path / "nan.npy", nan)
    np.save(tmp_path / "short.npy", np.ones((10, 32), np.float32))
    extra = [e.replace("NANFILE", str(tmp_path / "nan.npy")).replace("SHORTFILE", str(tmp_path / "short.npy")) for e in extra]
    out = tmp_path / "rep"
    rc = main(["profile", "--d-model", "32", "--tokens", "512", "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_header_names_the_weights_it_knows_and_never_prints_a_question_mark(tables):
    """Tables from a run carry no weight seed; a real model's layers have trained weights: say what is known."""
    assert "?" not in range_report_markdown(tables).split("\n")[2]
    assert "random weights of seed 5" in range_report_markdown(tables, {"seed": 5})
    layers = {"llama:L0": tables["swiglu"], "llama:L1": tables["swiglu"]}
    header = range_report_markdown(layers).split("\n")[2]
    assert "2 model layer(s)" in header and "trained weights" in header and "weights of seed" not in header and "?" not in header
