"""deploy.genai: onnxruntime-genai runs every kind of FFN graph a plan writes (static and per-token int8, a rotation,
8-bit weight-only, symmetric and asymmetric 4-bit, float sites) and produces ffnquant's tokens; its session computes
a weight-only graph as ffnquant's own session does (the config's session entries)."""

from __future__ import annotations

import pytest

from ffnquant.deploy import genai
from ffnquant.recipe import Recipe

pytestmark = pytest.mark.hf
needs_genai = pytest.mark.skipif(genai.genai_unavailable() is not None, reason=str(genai.genai_unavailable()))


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """A tiny 4-layer Llama (hidden 128, FFN 256)."""
    pytest.importorskip("transformers")
    from hf_models import write_vllm_llama

    return write_vllm_llama(tmp_path_factory.mktemp("genai") / "llama", layers=4)


def _planned(folder, recipes):
    from ffnquant.deploy import build_planned_model
    from ffnquant.hf import inspect_model
    from ffnquant.planning import Plan
    from ffnquant.planning.planfile import model_fingerprint

    info = inspect_model(folder)
    plan = Plan(model_fingerprint(info), {i: Recipe.parse(r) for i, r in enumerate(recipes)}, "ppl+1%", "latency")
    return build_planned_model(info, plan, calib_tokens=256, eval_tokens=128)


# the kinds tests/test_deploy_onnx_model.py's folder (static int8 with a float site, symmetric 4-bit) leaves out:
# dynamic (per-token) and weight-only nodes, static ones, rotations and a float layer, one graph of eight layers
KINDS = ["w8a8-dynamic-s8", "w8a8-dynamic-s8+rotate", "w4a16-g64-asym", "w8a16",
         "w8a8@minmax", "w8a8@search+float=input", "w8a8+rotate", "fp32"]


@needs_genai
def test_genai_generates_ffnquants_tokens_on_each_kind_of_graph(tmp_path):
    """The folder `export --format onnx` writes, run by genai's own loop: its greedy tokens equal ffnquant's loop on
    the same quantized graph, prompt by prompt (one graph, one arithmetic, the same session entries)."""
    from ffnquant.deploy.onnx_model import write_model_graph
    from hf_models import write_vllm_llama

    planned = _planned(write_vllm_llama(tmp_path / "llama8", layers=len(KINDS)), KINDS)
    result = write_model_graph(planned, tmp_path / "graph", tokens=(1, 16), rounds=2, contexts=(16,), prompts=2,
                               new_tokens=6)
    written = {row["recipe"] for row in result["quantize"]["modules"]}
    assert written == set(KINDS)
    check = result["decoder"]["genai"]
    assert check["ran"], check["reason"]
    assert check["equal"] and check["tokens_compared"] > 0, check["rows"]


@needs_genai
def test_genai_computes_a_weight_only_graph_as_ffnquants_session_does(tmp_path, llama4):
    """w8a16: onnxruntime's default fuses DequantizeLinear -> MatMul into MatMulNBits at accuracy level 4, which
    quantizes the activations; genai_config.json carries ffnquant's session entries, so genai's logits are those of
    ffnquant's own session on the same graph, bit for bit."""
    import numpy as np
    import onnxruntime_genai as og
    import torch

    from ffnquant.deploy import build_planned_model
    from ffnquant.deploy.onnx_decoder import cache_layout, export_decoder, float_tolerance, prefill_feed
    from ffnquant.deploy.onnx_rewrite import quantize_graph
    from ffnquant.hf import inspect_model
    from ffnquant.onnx.onnxquant import ort_session
    from ffnquant.planning import Plan
    from ffnquant.planning.planfile import model_fingerprint

    info = inspect_model(llama4)
    plan = Plan(model_fingerprint(info), {i: Recipe.parse("w8a16") for i in range(4)}, "ppl+1%", "latency")
    planned = build_planned_model(info, plan, calib_tokens=256, eval_tokens=128)
    export_decoder(planned.model, info, tmp_path / "planned.fp32.onnx", 17)
    quantize_graph(tmp_path / "planned.fp32.onnx", planned, tmp_path / "model.onnx")
    (tmp_path / "planned.fp32.onnx").unlink()
    config = genai.genai_config(planned.float_model.config, cache_layout(planned.float_model), "model.onnx")
    assert config["model"]["decoder"]["session_options"]["session.qdq_matmulnbits_accuracy_level"] == "0"
    genai.write_genai_files(tmp_path, llama4, config)
    ids = [[1, 5, 9, 13, 17, 21, 3, 4, 7, 8, 11, 12, 40, 41, 42, 43]]
    session = ort_session(tmp_path / "model.onnx")
    ours = session.run(["logits"], prefill_feed(session, torch.tensor(ids)))[0][0, -1]

    def genai_logits(level):
        config["model"]["decoder"]["session_options"]["session.qdq_matmulnbits_accuracy_level"] = level
        genai.write_genai_files(tmp_path, llama4, config)
        model = og.Model(str(tmp_path))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=32, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        return np.asarray(generator.get_output("logits"))[0, -1]

    # the two sessions differ in float32 summation order only (threads, the attention kernel's mask)
    tol = float_tolerance(float(np.abs(ours).max()), 4, 256)
    assert np.abs(genai_logits("0") - ours).max() <= tol
    # onnxruntime's default, quantized activations: far outside that (the test tells the two apart)
    assert np.abs(genai_logits("4") - ours).max() > 10 * tol
