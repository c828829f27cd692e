"""`quantize --model` and `run --model`: a real model's FFN layers through the same machinery as the variants.

Tiny local checkpoints (2 layers, d_model 32, d_ff 64) from `hf_models`; the ones built with
transformers are marked `hf` and skip without it, the hand-written ones run everywhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.pipeline import RunConfig, load_config
from onnx_checks import graph_db

from hf_models import D, tiny_folders, write_llama_like

# Static int8 per-site ranges on inputs with crest factors of ~5-30: each site leaves
# 6.02*8 + 4.77 - 20*log10(crest) ~ 23-39 dB, and the sites' errors add at the output.
INT8_FLOOR_DB = 20.0
# The ONNX artifact computes what the torch reference computes (same ranges, same grid): ORT's
# float accumulation order is the only difference (as in tests/test_onnxquant.py).
ONNX_GAP_DB = 0.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny BERT (encoder, gelu) and OPT (causal LM, relu) folder with their own tokenizer."""
    return {name: found[0] for name, found in tiny_folders(tmp_path_factory, ("bert", "opt")).items()}


@pytest.mark.hf
def test_quantize_model_writes_artifacts_and_a_row_per_layer(tiny, tmp_path, capsys):
    art, rep = tmp_path / "export", tmp_path / "reports"
    rc = main(["quantize", "--model", str(tiny["bert"]), "--scheme", "w8a8", "--calibrator", "auto", "--smooth", "0.5",
               "--calib-tokens", "256", "--eval-tokens", "128", "--out-artifacts", str(art), "--out-reports", str(rep)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "bert:L0" in out and "bert:L1" in out and "end to end, 2 FFN layer(s) quantized" in out
    data = json.loads((rep / "quantize_bert.w8a8-auto.smooth0.5.json").read_text())  # named by the recipe's slug
    assert (rep / "quantize_bert.w8a8-auto.smooth0.5.md").is_file()
    assert data["recipe"] == "w8a8@auto+smooth"
    assert [r["label"] for r in data["layers"]] == ["L0", "L1"]
    assert data["remedies"][0]["kind"] == "smooth" and "not positively homogeneous" in data["remedies"][0]["note"]
    for r in data["layers"]:
        # calibration and held-out inputs come from the two different texts, in the requested amounts
        assert (r["n_calib_tokens"], r["n_eval_tokens"]) == (256, 128)
        torch_db, onnx_db = r["accuracy_torch"]["sqnr_db"], graph_db(r["artifact"])
        assert torch_db > INT8_FLOOR_DB and abs(onnx_db - torch_db) < ONNX_GAP_DB
        path = Path(r["artifact"]["path"])
        assert path.parent == art and path.is_file() and path.name.startswith(f"bert.{r['label']}.")
    assert data["evaluation"]["source"] == "prose:evaluation (shipped corpus)"
    assert data["calibration"]["source"] == "prose:calibration (shipped corpus)"
    e2e = data["end_to_end"]
    assert e2e["status"] == "ok" and len(e2e["ablation"]) == 2
    # quantizing both layers costs at least as much as the better of the two alone (errors add)
    assert e2e["end_to_end"]["hidden_sqnr_db"] <= max(a["hidden_sqnr_db"] for a in e2e["ablation"]) + 0.5
    assert sorted(p.name for p in art.glob("*.onnx") if ".L1." in p.name) == [
        "bert.L1.fp32.onnx", "bert.L1.ort-default-static.onnx", "bert.L1.smooth0.5.fp32.onnx",
        "bert.L1.w8a8-auto.smooth0.5.onnx"]


@pytest.mark.hf
def test_profile_model_layers_next_to_the_variants(tiny, tmp_path):
    rc = main(["profile", "--variants", "gelu", "--d-model", "32", "--tokens", "256", "--model", str(tiny["bert"]),
               "--layers", "1", "--model-tokens", "64", "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "ranges.json").read_text())
    assert sorted(data["variants"]) == ["bert:L1", "gelu"]
    assert "bert:L1" in (tmp_path / "ranges.md").read_text()


def _captured(tmp_path: Path, rows: int) -> Path:
    folder = tmp_path / "captured"
    folder.mkdir()
    gen = np.random.default_rng(0)
    for label in ("L0", "L1"):
        np.save(folder / f"{label}.npy", gen.standard_normal((rows, D)).astype(np.float32))
    return folder


def test_quantize_model_from_captured_files_needs_no_transformers(tmp_path):
    write_llama_like(tmp_path / "m")
    rc = main(["quantize", "--model", str(tmp_path / "m"), "--captured", str(_captured(tmp_path, 400)), "--scheme",
               "w8a8-dynamic", "--calib-tokens", "300", "--eval-tokens", "200", "--no-onnx",
               "--out-artifacts", str(tmp_path / "export"), "--out-reports", str(tmp_path / "reports")])
    assert rc == 0
    data = json.loads((tmp_path / "reports" / "quantize_llama-m.w8a8-dynamic.json").read_text())
    # the first 300 rows calibrate, the remaining 100 (of 200 asked) are held out
    assert [(r["n_calib_tokens"], r["n_eval_tokens"]) for r in data["layers"]] == [(300, 100), (300, 100)]
    assert all(r["accuracy_torch"]["sqnr_db"] > INT8_FLOOR_DB for r in data["layers"])
    assert data["end_to_end"]["status"] == "missing" and "captured files" in data["end_to_end"]["reason"]
    assert not list((tmp_path / "export").glob("*"))


def _bad_model_cases():
    def missing(p):
        return p / "nope"

    def unsupported(p):
        write_llama_like(p / "m", model_type="llama")
        cfg = json.loads((p / "m" / "config.json").read_text())
        (p / "m" / "config.json").write_text(json.dumps(dict(cfg, model_type="mamba")))
        return p / "m"

    def corrupt(p):
        write_llama_like(p / "m")
        (p / "m" / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file")
        return p / "m"

    return [
        pytest.param(missing, "does not exist or is not a folder", id="missing-folder"),
        pytest.param(unsupported, "mixer: ffnquant cannot reproduce this FFN's output", id="unsupported"),
        pytest.param(corrupt, "cannot read safetensors file", id="corrupt"),
    ]


@pytest.mark.parametrize("command", ["quantize", "run"], ids=str)
@pytest.mark.parametrize("make,message", _bad_model_cases())
def test_bad_model_folder_exits_2_and_writes_nothing(tmp_path, capsys, command, make, message):
    folder = make(tmp_path)
    out, export = tmp_path / "out", tmp_path / "export"
    if command == "quantize":
        argv = ["quantize", "--model", str(folder), "--out-reports", str(out), "--out-artifacts", str(export)]
    else:
        argv = ["run", "--tiny", "--model", str(folder), "--out", str(out), "--export", str(export)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not out.exists() and not export.exists()


def test_quantize_model_input_errors_exit_2(tmp_path, capsys):
    write_llama_like(tmp_path / "m")
    base = ["quantize", "--model", str(tmp_path / "m"), "--out-reports", str(tmp_path / "out"),
            "--out-artifacts", str(tmp_path / "export")]
    # a scheme ffnquant cannot quantize itself (a runtime-only kernel): an input error, before anything is written
    assert main(base + ["--scheme", "llm-int8", "--captured", str(_captured(tmp_path, 400))]) == 2
    assert "llm-int8" in capsys.readouterr().err
    # no rows left for held-out evaluation
    assert main(base + ["--scheme", "w8a8", "--captured", str(tmp_path / "captured"), "--calib-tokens", "400"]) == 2
    assert "none is left for evaluation" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "export").exists()


@pytest.mark.hf
def test_run_with_model_puts_its_layers_next_to_the_variants(tiny, tmp_path, capsys):
    from ffnquant.report import validate_report

    out, export = tmp_path / "reports", tmp_path / "export"
    rc = main(["run", "--tiny", "--variants", "relu", "--schemes", "fp32,w8a8@auto,w4a16-g64", "--runtimes", "ort-cpu",
               "--tokens", "1,16", "--calib-tokens", "256", "--eval-tokens", "128", "--no-sensitivity",
               "--model", str(tiny["opt"]), "--out", str(out), "--export", str(export)])
    assert rc == 0
    doc = json.loads((out / "report.json").read_text())
    validate_report(doc)
    model = doc["model"]
    keys = [layer["key"] for layer in model["layers"]]
    assert keys == ["opt:L0", "opt:L1"] and model["variant"] == "relu"
    assert set(keys) <= set(doc["ranges"]["variants"])
    rows = {(r["variant"], r["scheme"]): r for r in doc["accuracy"]["rows"]}
    for key in keys:
        assert rows[(key, "w8a8@auto")]["status"] == "ok" and rows[(key, "w8a8@auto")]["sqnr_db"] > INT8_FLOOR_DB
        # group 64 is wider than the model's d_model 32: one group padded with zero columns, quantized all the same
        assert rows[(key, "w4a16-g64")]["status"] == "ok" and rows[(key, "w4a16-g64")]["sqnr_db"] is not None
    assert rows[("relu", "w4a16-g64")]["status"] == "ok"
    assert model["skipped"] == []
    e2e = model["end_to_end"]
    assert e2e["status"] == "ok" and e2e["baseline"]["perplexity"] > 1
    (w8,) = [s for s in e2e["schemes"] if s["scheme"] == "w8a8@auto"]
    assert w8["end_to_end"]["perplexity_delta"] is not None and len(w8["ablation"]) == 2
    # latency: the first selected layer stands for all of them, next to the variant on the same runtime
    cases = {(c["variant"], c["scheme"]) for c in doc["timing"]["latency"]["cases"] if c["error"] is None}
    assert {("opt:L0", "fp32"), ("opt:L0", "w8a8@auto"), ("relu", "w8a8@auto")} <= cases
    assert model["latency"]["layer"] == "opt:L0"
    arts = [a for a in doc["artifacts"] if a["variant"] in keys]
    # printed as export/<file> (the folder's name, not this machine's absolute path); the file is there
    assert arts and all(Path(a["path"]).name.startswith(("opt.L0.", "opt.L1.")) and Path(a["path"]).parent.name == "export"
                        and (export / Path(a["path"]).name).is_file() for a in arts)
    md = (out / "report.md").read_text()
    assert "## Real model: opt layers next to the variants" in md and "| opt:L1 | w8a8 (auto) |" in md
    assert load_config(out / "run.toml").model == str(tiny["opt"])


def test_run_config_model_fields_round_trip(tmp_path):
    cfg = RunConfig.tiny(model="some/folder", layers=[0, 2], text="calib.txt", eval_text="eval.txt")
    assert cfg.layers == "0,2"
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    assert load_config(path) == cfg
    assert RunConfig.tiny(model="m", layers="all").layers is None
    with pytest.raises(FFNQuantError, match="layers, text select.* give model too"):
        RunConfig.tiny(layers="0-1", text="a.txt")
    with pytest.raises(FFNQuantError, match="layers must be a string"):
        RunConfig.tiny(model="m", layers=["a"])
    # the default run is untouched: no model keys in its TOML
    default = RunConfig().to_toml().splitlines()
    assert not [line for line in default if line.split(" = ")[0] in ("model", "layers", "text", "eval_text")]


def _copies(tmp_path: Path, n: int) -> list[str]:
    """`n` copies of the shipped calibration sample, as separate text files."""
    from ffnquant.hf.capture import default_text_path

    text = default_text_path("calibration").read_text(encoding="utf-8")
    paths = []
    for i in range(n):
        p = tmp_path / f"text{i}.txt"
        p.write_text(text, encoding="utf-8")
        paths.append(str(p))
    return paths


@pytest.mark.hf
def test_profile_model_header_says_what_was_measured(tiny, tmp_path, capsys):
    """The header names the model's width, the real tokens per layer and the text, not the synthetic source's
    token count and width; a default token count larger than the text gives is reported as such."""
    from ffnquant.hf.capture import default_text_path

    short = str(default_text_path("calibration"))  # the small sample: fewer tokens than the default 4,096
    out_dir = tmp_path / "r"
    assert main(["profile", "--variants", "gelu", "--d-model", "64", "--tokens", "256", "--model", str(tiny["opt"]),
                 "--layers", "1", "--text", short, "--out", str(out_dir)]) == 0
    out = capsys.readouterr().out
    data = json.loads((out_dir / "ranges.json").read_text())
    n = data["variants"]["opt:L1"]["n_tokens"]
    assert 2 <= n < 4096
    assert "1 variant(s) on 256 tokens of gaussian(seed=0), d_model 64" in out
    assert f"1 FFN layer(s) at d_model {D}, {n:,} tokens per layer of text {short}" in out
    assert f"note: calibration text {short} gives {n:,} tokens, fewer than the 4,096 requested" in out
    assert "too short" in out
    measured = data["meta"]["model_measured"]
    assert measured["calibration_text"]["requested"] == 4096 and measured["calibration_text"]["obtained"] == n
    header = (out_dir / "ranges.md").read_text().split("\n\n")[1]
    assert f"d_model {D}" in header and f"{n:,} tokens per layer" in header and "too short" in header

    # several texts, repeated and comma-separated: all are used
    a, b, c = _copies(tmp_path, 3)
    out_dir = tmp_path / "r2"
    assert main(["profile", "--variants", "gelu", "--d-model", "64", "--tokens", "256", "--model", str(tiny["opt"]),
                 "--layers", "1", "--text", a, "--text", f"{b},{c}", "--out", str(out_dir)]) == 0
    capsys.readouterr()
    data = json.loads((out_dir / "ranges.json").read_text())
    assert data["variants"]["opt:L1"]["n_tokens"] >= 3 * n - 2
    assert data["meta"]["model_measured"]["source"] == f"text {a} + {b} + {c}"


@pytest.mark.hf
def test_quantize_model_reports_requested_and_obtained_tokens(tiny, tmp_path, capsys):
    rep = tmp_path / "reports"
    from ffnquant.hf.capture import default_text_path

    argv = ["quantize", "--model", str(tiny["opt"]), "--layers", "0", "--scheme", "w8a8-dynamic", "--no-onnx",
            "--out-reports", str(rep), "--out-artifacts", str(tmp_path / "e"),
            # the small sample, shorter than the budget
            "--eval-text", str(default_text_path("evaluation"))]
    assert main(argv + ["--text", str(default_text_path("calibration"))]) == 0  # the defaults: 4,096 and 2,048
    out = capsys.readouterr().out
    data = json.loads(next(rep.glob("quantize_opt*.json")).read_text())
    cal, ev = data["calibration"]["tokens"], data["evaluation"]["tokens"]
    assert (cal["requested"], ev["requested"]) == (4096, 2048) and cal["short"] and ev["short"]
    assert cal["obtained"] == data["layers"][0]["n_calib_tokens"]
    assert f"gives {cal['obtained']:,} tokens, fewer than the 4,096 requested" in out
    assert f"gives {ev['obtained']:,} tokens, fewer than the 2,048 requested" in out
    md = next(rep.glob("quantize_opt*.md")).read_text()
    assert f"gives {cal['obtained']:,} of the 4,096 tokens requested: the text is too short" in md

    a, b = _copies(tmp_path, 2)
    assert main(argv + ["--text", f"{a},{b}", "--out-reports", str(tmp_path / "r2")]) == 0
    capsys.readouterr()
    data2 = json.loads(next((tmp_path / "r2").glob("quantize_opt*.json")).read_text())
    assert data2["calibration"]["tokens"]["obtained"] >= 2 * cal["obtained"] - 2
    assert data2["calibration"]["source"].startswith(f"{a} + {b}")


@pytest.mark.hf
def test_quantize_model_shows_progress_per_stage_and_can_skip_ablation(tiny, tmp_path, capsys):
    rep = tmp_path / "reports"
    argv = ["quantize", "--model", str(tiny["opt"]), "--scheme", "w8a8-dynamic", "--no-onnx", "--calib-tokens", "256",
            "--eval-tokens", "256", "--out-reports", str(rep), "--out-artifacts", str(tmp_path / "e")]
    assert main(argv + ["--no-ablation"]) == 0
    captured = capsys.readouterr()
    # a bar per stage on stderr, each finished; stdout keeps the results only (a causal LM: the engine's stages)
    for stage in ("embed calibration", "embed evaluation", "quantize layers", "layers", "end to end"):
        assert stage in captured.err
    assert "ablation" not in captured.err and "quantize layers" not in captured.out
    assert "2/2" in captured.err  # both layers quantized
    assert "per-layer ablation skipped (--no-ablation)" in captured.out
    data = json.loads(next(rep.glob("quantize_opt*.json")).read_text())
    assert data["ablation"] is False and data["end_to_end"]["ablation"] == []
    assert data["end_to_end"]["status"] == "ok" and data["end_to_end"]["end_to_end"]["perplexity"] > 0

    # with the ablation (the default): a stream per layer beside the quantized one
    assert main(argv + ["--out-reports", str(tmp_path / "r2")]) == 0
    data = json.loads(next((tmp_path / "r2").glob("quantize_opt*.json")).read_text())
    assert data["ablation"] is True and len(data["end_to_end"]["ablation"]) == 2


@pytest.mark.hf
def test_model_library_functions_report_progress_and_never_print(tiny, capsys):
    from ffnquant.hf import EvalSettings, capture_layer_inputs, inspect_model, load_ffn_layers, quantize_model_layers

    info = inspect_model(tiny["opt"])
    layers = load_ffn_layers(info)
    seen: list[tuple[str, int, int]] = []
    settings = EvalSettings(max_calib_tokens=128, max_eval_tokens=128)
    inputs = capture_layer_inputs(info, layers, calib_tokens=128, eval_tokens=128, settings=settings,
                                  progress=lambda m, d, t: seen.append((m, d, t)))
    quantize_model_layers(info, layers, inputs, "w8a8-dynamic", onnx=False, sensitivity=False, settings=settings,
                          progress=lambda m, d, t: seen.append((m, d, t)))
    assert capsys.readouterr().out == ""
    stages = {m.split(": ")[0] for m, _, _ in seen}  # a causal LM's inputs and figures come through the engine
    assert stages == {"capture calibration inputs", "capture evaluation inputs", "capture inputs", "quantize layers",
                      "end to end"}
    assert [(m, d, t) for m, d, t in seen if m.startswith("quantize layers")] == [
        ("quantize layers: L0", 1, 2), ("quantize layers: L1", 2, 2)]
    assert all(0 < d <= t for _, d, t in seen)


@pytest.mark.hf
def test_run_with_model_says_when_a_text_gives_fewer_tokens_than_asked(tiny, tmp_path, capsys):
    """run --model records requested against obtained tokens per text and says when a text is short
    (it used to shrink the counts silently)."""
    from ffnquant.hf.capture import default_text_path

    out = tmp_path / "reports"
    rc = main(["run", "--tiny", "--variants", "relu", "--schemes", "fp32,w8a8", "--runtimes", "none",
               "--calib-tokens", "100000", "--eval-tokens", "64", "--text", str(default_text_path("calibration")), "--no-sensitivity", "--no-onnx",
               "--model", str(tiny["opt"]), "--out", str(out), "--export", str(tmp_path / "export")])
    assert rc == 0
    model = json.loads((out / "report.json").read_text())["model"]
    cal, ev = model["calibration"]["tokens"], model["evaluation"]["tokens"]
    assert cal["requested"] == 100000 and cal["short"] and cal["obtained"] < 100000
    assert ev["requested"] == 64 and not ev["short"]
    assert "fewer than the 100,000 requested" in capsys.readouterr().err
    assert "Note: calibration text" in (out / "report.md").read_text()
