"""benchmarks/serve.py: its table says each folder's speed against the source's, and a refusal with vLLM's reason."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SERVE = Path(__file__).resolve().parent.parent / "benchmarks" / "serve.py"


@pytest.fixture(scope="module")
def serve():
    spec = importlib.util.spec_from_file_location("serve_benchmark", SERVE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_is_against_the_source_and_names_refusals(serve):
    row = {"load_s": 20.0, "prefill_s": 0.5, "kernels": []}
    doc = {"model": "m", "vllm": "0.32.0", "genai_builder": {"genai-builder-fp32": "python -m builder -p fp32"},
           "genai_rows": {"genai-builder-fp32": {**row, "decode_tok_s_1": 20.0, "decode_tok_s_concurrent": 60.0,
                                                 "genai": "0.18.0"},
                          "w8a8-onnx": {**row, "decode_tok_s_1": 25.0, "decode_tok_s_concurrent": 90.0, "genai": "0.18.0",
                                        "kernels": ["MatMulInteger x60"], "ffn_share_decode": 0.25,
                                        "ffn_share_prefill": 0.6},
                          "broken": {"error": "RuntimeError: unknown model type"}}, "command": "python3 benchmarks/serve.py --model m",
           "environment": {"cpu": "AMD EPYC", "cpu_count": 2, "timestamp_utc": "t"},
           "settings": {"dtype": "bfloat16", "prompt_tokens": 512, "new_tokens": 64, "concurrent": 8, "repeats": 3},
           "rows": {"source": {**row, "decode_tok_s_1": 10.0, "decode_tok_s_concurrent": 40.0},
                    "w8a8": {**row, "decode_tok_s_1": 12.5, "decode_tok_s_concurrent": 30.0, "ffn_ms_1": 40.0,
                             "ffn_ms_concurrent": 160.0, "ffn_ms_prefill": 250.0,
                             "kernels": ["Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8"]},
                    "w8a16": {"error": "ValueError: Failed to find a kernel", "seconds": 20.0}}}
    text = serve.render(doc)
    # a step of one request takes 1000 / 12.5 = 80 ms (FFNs 40 ms: 50%); of 8, 8000 / 30 = 267 ms (160 ms: 60%)
    assert ("| w8a8 | 20 s | 500 ms | 12.5 tok/s | 30.0 tok/s | 1.25x / 0.75x | 50% / 60% | 50% "
            "| Selected CPUInt8ScaledMMLinearKernel") in text
    assert "| source | 20 s | 500 ms | 10.0 tok/s | 40.0 tok/s | 1.00x / 1.00x | - / - | - |" in text
    # genai's rows against genai's own float32 build
    assert "| w8a8-onnx | 20.0 s | 500 ms | 25.0 tok/s | 90.0 tok/s | 1.25x / 1.50x | 25% / 60% | MatMulInteger x60 |" in text
    assert "| genai-builder-fp32 | 20.0 s | 500 ms | 20.0 tok/s | 60.0 tok/s | 1.00x / 1.00x | - | none |" in text
    assert "| broken | failed: RuntimeError: unknown model type |" in text
    assert "| w8a16 | refused: ValueError: Failed to find a kernel |" in text


@pytest.mark.parametrize("row, want", [
    ({"decode_tok_s_1": 20.0, "decode_tok_s_concurrent": 80.0, "ffn_ms_1": 25.0, "ffn_ms_concurrent": 50.0}, (0.5, 0.5)),
    ({"decode_tok_s_1": 20.0, "decode_tok_s_concurrent": 80.0}, (None, None)),
], ids=["timed", "not-timed"])
def test_the_ffn_share_is_their_time_over_the_step(serve, row, want):
    got = serve.ffn_shares(row, 8)
    assert got == pytest.approx(want) if want[0] is not None else got == want


def test_without_vllm_it_stops_with_the_reason(serve, monkeypatch, tmp_path):
    from ffnquant.deploy import vllm

    monkeypatch.setattr(vllm, "vllm_unavailable", lambda: "vLLM is not installed in this environment")
    with pytest.raises(SystemExit, match="serve: vLLM is not installed"):
        serve.main(["--model", "m", "--out", str(tmp_path / "o")])


def test_genai_rows_without_genai_stop_with_the_reason(serve, monkeypatch, tmp_path):
    from ffnquant.deploy import genai

    monkeypatch.setattr(genai, "genai_unavailable", lambda: "onnxruntime-genai is not installed")
    with pytest.raises(SystemExit, match="serve: onnxruntime-genai is not installed"):
        serve.main(["--model", "m", "--no-vllm", "--genai", "a=b", "--out", str(tmp_path / "o")])


def test_without_genais_float_build_the_genai_rows_are_against_ffnquants_float_graph(serve):
    """genai's builder may not build the source (Gemma 3: KeyError 'rope_type'): the rows are then against ffnquant's
    own float32 decoder (`--genai fp32-graph=FOLDER`), and the table says so."""
    row = {"load_s": 2.0, "prefill_s": 1.0, "kernels": [], "genai": "0.18.0"}
    doc = {"model": "m", "vllm": None, "rows": {}, "command": "python3 benchmarks/serve.py --model m --no-vllm",
           "genai_builder": {"genai-builder-fp32": "python -m builder -p fp32"},
           "environment": {"cpu": "AMD EPYC", "cpu_count": 2, "timestamp_utc": "t"},
           "settings": {"dtype": "bfloat16", "prompt_tokens": 512, "new_tokens": 64, "concurrent": 8, "repeats": 3},
           "genai_rows": {"genai-builder-fp32": {"error": "the builder failed: KeyError: 'rope_type'"},
                          "fp32-graph": {**row, "decode_tok_s_1": 10.0, "decode_tok_s_concurrent": 40.0},
                          "plan": {**row, "decode_tok_s_1": 15.0, "decode_tok_s_concurrent": 60.0}}}
    text = serve.render(doc)
    assert "Against fp32-graph (genai's builder did not build the source's float32 graph)." in text
    assert "| against fp32-graph (1 / 8) |" in text and "| 1.50x / 1.50x |" in text
