"""deploy.onnx_model: a planned tiny Llama (2 layers, d_model 32) as one ONNX graph: the fp32 export against
torch, the quantized graph scored against ffnquant's torch reference, per-token int8, the refusals, latency;
deploy.onnx_decoder: the graph as a decoder with a KV cache, its greedy generation against transformers' on the
families the graph takes, its perplexity through the cache, decode latency, and the prefill graph it falls
back to."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

import pytest
import torch

from ffnquant.deploy.onnx_model import PPL_TOLERANCE
from ffnquant.errors import FFNQuantError
from ffnquant.measure.latency import REFERENCE_TOLERANCE_DB

from hf_models import tiny_folders

pytestmark = pytest.mark.hf


def _planned(folder, recipes):
    from ffnquant.deploy import build_planned_model
    from ffnquant.hf import inspect_model
    from ffnquant.planning import Plan
    from ffnquant.planning.planfile import model_fingerprint
    from ffnquant.recipe import Recipe

    info = inspect_model(folder)
    plan = Plan(model_fingerprint(info), {i: Recipe.parse(r) for i, r in enumerate(recipes)}, "ppl+1%", "latency")
    return build_planned_model(info, plan, calib_tokens=256, eval_tokens=128)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_folders(tmp_path_factory, ("llama",))["llama"][0]


@pytest.fixture(scope="module")
def written(llama, tmp_path_factory):
    """A static w8a8 layer with a float hidden site (and SmoothQuant folded into its norm) and a 4-bit layer."""
    from ffnquant.deploy.onnx_model import write_model_graph

    planned = _planned(llama, ["w8a8@search+smooth+float=hidden", "w4a16-g32"])
    folder = tmp_path_factory.mktemp("graph")
    # 1024 tokens of context lie beyond the tiny model's 64 positions: left out, and said so
    return planned, folder, write_model_graph(planned, folder, tokens=(1, 16), rounds=3, contexts=(16, 64, 1024))


def test_the_float_graph_is_the_float_model(written):
    from ffnquant.deploy.onnx_decoder import prefill_feed
    from ffnquant.deploy.onnx_model import float_tolerance
    from ffnquant.onnx.onnxquant import ort_session

    planned, folder, result = written
    assert result["parity"]["float"]["passed"] and result["parity"]["planned"]["passed"]
    # no leftovers: the two graphs and what onnxruntime-genai reads beside them (`deploy.genai`)
    assert sorted(p.name for p in folder.iterdir()) == sorted(["model.fp32.onnx", "model.onnx"]
                                                              + result["decoder"]["genai"]["files"])
    assert result["files"]["model.fp32.onnx"] == (folder / "model.fp32.onnx").stat().st_size
    # another shape than the export's example and the parity batch: batch and sequence are dynamic
    ids = torch.randint(0, 96, (3, 21), generator=torch.Generator().manual_seed(5))
    session = ort_session(folder / "model.fp32.onnx")
    logits, hidden = session.run(["logits", "last_hidden"], prefill_feed(session, ids))
    with torch.no_grad():
        out = planned.float_model(input_ids=ids, use_cache=False, output_hidden_states=True)
    info = planned.info
    for got, ref in ((logits, out.logits), (hidden, out.hidden_states[-1])):
        ref = ref.numpy()
        # float32 summation order only (onnxruntime's kernels vs torch's): float_tolerance's roundoff budget
        tol = float_tolerance(np.abs(ref).max(), info.n_layers, max(info.spec.d_model, info.spec.d_ff))
        assert got.shape == ref.shape and np.abs(got - ref).max() <= tol


def test_the_quantized_graph_scores_as_the_torch_reference(written):
    planned, folder, result = written
    q, score = result["quantize"], result["score"]
    assert q["kinds"] == {"qdq": 2, "float": 1, "nbits": 3}
    # one QuantizeLinear feeds both w_gate and w_up of layer 0; the 4-bit layer is three MatMulNBits
    assert q["nodes"]["quantized"]["QuantizeLinear"] == 1 and q["nodes"]["quantized"]["MatMulNBits"] == 3
    assert q["nodes"]["quantized"]["MatMul"] == q["nodes"]["float"]["MatMul"] - 3  # QDQ keeps its MatMuls
    assert score["provider"] == "CPUExecutionProvider" and score["providers"][0] == "CPUExecutionProvider"
    # the bar: perplexity within 0.5% of ffnquant's torch figure of the same plan
    assert score["meets_tolerance"] and abs(score["perplexity_rel_diff"]) <= 0.005
    # the same codes and ranges on both sides: only float rounding (a code flipping at a rounding tie) differs,
    # far inside the 0.5 dB ffnquant holds every ONNX artifact to
    assert abs(score["hidden_sqnr_db_diff"]) <= REFERENCE_TOLERANCE_DB
    assert result["files"]["model.onnx"] < result["files"]["model.fp32.onnx"]


def test_a_looped_depths_ffn_called_again_is_every_call_rewritten_from_one_set_of_codes(tmp_path):
    """Dory calls its two layers twice each (layers L2, L3 calling L0's and L1's FFN again): every MatMul of every
    call is rewritten (4-bit MatMulNBits for one FFN, per-token int8 MatMulInteger for the other, each call's own
    nodes named apart), each weight's codes stored once, and the graph scores as ffnquant's reference."""
    from onnx import load

    from ffnquant.deploy.onnx_model import DEFAULT_OPSET, _export, score_graph
    from ffnquant.deploy.onnx_rewrite import quantize_graph
    from hf_models import tiny_or_skip

    planned = _planned(tiny_or_skip("dory", tmp_path / "dory"), ["w4a16-g32", "w8a8-dynamic-s8"] * 2)
    float_path, path = tmp_path / "planned.fp32.onnx", tmp_path / "model.onnx"
    _export(planned.model, planned.info, float_path, DEFAULT_OPSET, planned.evals[0][:1, :64])  # the prefill graph
    q, score = quantize_graph(float_path, planned, path), score_graph(path, planned)
    # three matmuls per FFN, each FFN called twice
    assert q["nodes"]["quantized"]["MatMulNBits"] == 3 * 2 and q["nodes"]["quantized"]["MatMulInteger"] == 3 * 2
    codes = sorted(i.name for i in load(str(path)).graph.initializer if i.name.endswith(("_Q4", "_quantized")))
    assert codes == sorted([f"model_layers_0_mlp_{p}_proj_Q4" for p in ("gate", "up", "down")]
                           + [f"model_layers_1_mlp_{p}_proj_quantized" for p in ("gate", "up", "down")])
    assert score["meets_tolerance"] and abs(score["hidden_sqnr_db_diff"]) <= REFERENCE_TOLERANCE_DB


def test_latency_is_side_by_side_and_ordered(written):
    latency = written[2]["latency"]
    assert set(latency["tokens"]) == {"1", "16"} and latency["provider"] == "CPUExecutionProvider"
    for row in latency["tokens"].values():
        for graph in ("float", "quantized"):
            r = row[graph]
            assert 0 < r["p10_ms"] <= r["p50_ms"] <= r["p90_ms"] and r["samples"] == 3
        assert row["speedup"] == pytest.approx(row["float"]["p50_ms"] / row["quantized"]["p50_ms"])


def test_per_token_int8_and_weight_only_int8_score_as_the_reference(llama, tmp_path):
    """w8a8-dynamic-s8 (per-token ranges computed in the graph, MatMulInteger) and w8a16 (weight DQ only)."""
    import onnx

    from ffnquant.deploy.onnx_model import export_float_graph, score_graph
    from ffnquant.deploy.onnx_rewrite import quantize_graph

    planned = _planned(llama, ["w8a8-dynamic-s8", "w8a16"])
    source = export_float_graph(planned.model, planned.info, tmp_path / "planned.fp32.onnx")
    q = quantize_graph(source, planned, tmp_path / "model.onnx")
    assert q["kinds"] == {"dynamic-int8": 3, "weight-dq": 3} and q["file"] == "model.onnx"  # no machine path
    assert q["nodes"]["quantized"]["MatMulInteger"] == 3 and "DynamicQuantizeLinear" not in q["nodes"]["quantized"]
    # the file says how a session keeps w8a16's activations float (onnxruntime's default does not)
    props = {p.key: p.value for p in onnx.load(str(tmp_path / "model.onnx")).metadata_props}
    assert props["ffnquant_session_config"] == "session.qdq_matmulnbits_accuracy_level=0"
    score = score_graph(tmp_path / "model.onnx", planned)
    assert score["meets_tolerance"] and abs(score["hidden_sqnr_db_diff"]) <= REFERENCE_TOLERANCE_DB


def test_an_fp8_plan_is_refused_in_one_line_before_anything_is_written(llama, tmp_path):
    from ffnquant.deploy.onnx_model import write_model_graph

    planned = _planned(llama, ["fp8-e4m3", "w4a16-g32"])
    with pytest.raises(FFNQuantError) as err:
        write_model_graph(planned, tmp_path / "out")
    msg = str(err.value)
    assert "\n" not in msg and "recipe fp8-e4m3" in msg and "fp8" in msg
    assert not (tmp_path / "out").exists()


def test_modules_without_an_honest_graph_are_refused_naming_the_recipe(written, tmp_path):
    """Checked per module before the graph is even read (the path here does not exist)."""
    from types import SimpleNamespace

    from ffnquant.deploy.onnx_rewrite import quantize_graph
    from ffnquant.schemes import get_scheme

    planned = written[0]
    static = next(m for m in planned.modules if m.input_mode == "static")  # L0 w_up: int8 grid, static input
    four = next(m for m in planned.modules if m.grid is not None and m.grid.bits == 4)
    cases = {
        "llm-int8": (dataclasses.replace(static, scheme=get_scheme("llm-int8"), input_mode="dynamic", input_range=None,
                                         recipe="llm-int8"), "outlier"),
        "w4a8": (dataclasses.replace(four, input_mode="static", input_range=static.input_range, recipe="w4a8-made-up"),
                 "MatMulNBits takes float activations"),
        "int8-g32": (dataclasses.replace(static, grid=dataclasses.replace(static.grid, granularity="per_group"),
                                         recipe="w8-g32-made-up"), "per_group"),
    }
    for name, (module, words) in cases.items():
        with pytest.raises(FFNQuantError) as err:
            quantize_graph(tmp_path / "absent.onnx", SimpleNamespace(modules=[module]), tmp_path / "out.onnx")
        msg = str(err.value)
        assert "\n" not in msg and f"recipe {module.recipe}" in msg and words in msg, name
    assert not (tmp_path / "out.onnx").exists()


def test_graph_refusal_names_the_protobuf_limit(written):
    from ffnquant.deploy.onnx_model import graph_refusal

    info = written[0].info
    assert graph_refusal(info) is None
    why = graph_refusal(dataclasses.replace(info, n_params_total=600_000_000))
    assert "2 GiB" in why and "\n" not in why


def _real_graph_refusal(text: str) -> str | None:
    """What the graph's rewrite says of a small FFN really quantized under `text` (every matmul's ModuleQuant, as
    `deploy.planned` makes them): None, or its refusal."""
    from ffnquant import build
    from ffnquant.deploy.onnx_rewrite import module_kind
    from ffnquant.deploy.planned import _module_quants
    from ffnquant.methods.fakequant import input_hessians, quantize_model
    from ffnquant.numerics.observe import profile
    from ffnquant.recipe import Recipe
    from ffnquant.spec import FFNSpec, Variant

    model = build(FFNSpec(Variant.SWIGLU, 32, 64), seed=0)
    recipe = Recipe.parse(text)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    table = profile(model, [x], weights=False)
    weights, sites = recipe.quantized_parts(model.spec)
    names = {w: f"m.{w}" for w in ("w_up", "w_gate", "w_down")}
    try:
        q = quantize_model(model, recipe.scheme, table, recipe.calibrator, weights=weights, sites=sites,
                           hessians=input_hessians(model, [x]))
        for m in _module_quants("L0", 0, recipe, q, names):
            module_kind(m)
    except FFNQuantError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("text", ["fp32", "fp16", "w8a16", "w8a8", "w8a8-s8", "w8a8-dynamic", "w8a8-dynamic-s8",
                                  "w4a16-g32", "w4a16-g32-asym", "w4a16-g32-hqq", "w4a16-g32-gptq", "w4a16-g32-awq",
                                  "nf4", "fp4", "fp8-e4m3", "fp8-e4m3-pc", "fp8-e4m3-dynamic", "llm-int8",
                                  "fp8-e4m3+float=input", "w8a8-dynamic-s8+float=hidden", "w8a8@search+float=input"])
def test_recipe_refusals_say_what_the_graph_rewrite_says_of_real_grids(text, monkeypatch):
    """`recipe_refuser` decides from the recipe alone (before a plan chooses it); the graph's rewrite decides on the
    quantized model: they agree on every preset, float sites included."""
    from types import SimpleNamespace

    from ffnquant.deploy import onnx_model
    from ffnquant.recipe import Recipe
    from ffnquant.spec import FFNSpec, Variant

    monkeypatch.setattr(onnx_model, "graph_refusal", lambda info: None)  # the model gets its whole graph
    predicted = onnx_model.recipe_refuser(SimpleNamespace(spec=FFNSpec(Variant.SWIGLU, 32, 64), layers=[]))(
        Recipe.parse(text))
    real = _real_graph_refusal(text)
    assert (predicted is None) == (real is None), (predicted, real)
    if predicted is not None:
        assert predicted.startswith(f"recipe {text} cannot be written in the whole-model ONNX graph: ")
        assert "\n" not in predicted


# --- the decoder with a KV cache ---------------------------------------------------------------------

def test_the_graph_is_a_decoder_in_onnxruntime_genais_layout(written):
    """The names and dims onnxruntime-genai's model builder writes and its genai_config.json names."""
    from ffnquant.onnx.onnxquant import ort_session

    planned, folder, result = written
    assert result["decoder"]["status"] == "ok"
    n = planned.info.n_layers
    for name in ("model.fp32.onnx", "model.onnx"):
        session = ort_session(folder / name)
        inputs = {i.name: i.shape for i in session.get_inputs()}
        outputs = {o.name: o.shape for o in session.get_outputs()}
        assert inputs["input_ids"] == ["batch_size", "sequence_length"] == inputs["position_ids"]
        assert inputs["attention_mask"] == ["batch_size", "total_sequence_length"]
        assert outputs["logits"] == ["batch_size", "sequence_length", 96]
        for i in range(n):
            for kv in ("key", "value"):
                assert inputs[f"past_key_values.{i}.{kv}"] == ["batch_size", 2, "past_sequence_length", 8]
                assert outputs[f"present.{i}.{kv}"] == ["batch_size", 2, "total_sequence_length", 8]
        assert len(inputs) == 3 + 2 * n and len(outputs) == 2 + 2 * n
    # the parity at export: at once (past 0) and half at once then a token per call, both against torch
    parity = result["parity"]["float"]
    assert parity["compared"] == ["logits", "last_hidden", "cached_logits"] and parity["passed"]


def test_a_decode_step_copies_the_cache_only_into_the_presents(written, tmp_path):
    """A decode step's work grows with the context only as attention must: what onnxruntime ran for one token on a
    past of 50 (its nodes' output shapes, from its profiler) holds no [total, total] tensor, no copy of a layer's
    cache larger than the layer's present (the kv heads repeated to the query heads, as the decomposed SDPA did)
    and, over the whole step, no tensor with a total-length dim beyond the presents themselves and the mask's
    per-position vectors; every layer's attention is one Attention node, in the fp32 and the quantized graph."""
    from math import prod

    from ffnquant.deploy.onnx_decoder import decode_step_tensors

    planned, folder, result = written
    n, kv, head = planned.info.n_layers, 2, 8
    total = 51  # no other dim of the tiny model (32, 64, 96, 4, 2, 8) is 51
    present = kv * total * head
    assert result["decoder"]["attention"].startswith("one Attention node per layer")
    for name in ("model.fp32.onnx", "model.onnx"):
        ran = decode_step_tensors(folder / name, total - 1, tmp_path)
        assert sum(r["op"] == "Attention" for r in ran) == n
        grown = [(r["node"], s) for r in ran for s in r["shapes"] if total in s]
        assert not [g for g in grown if g[1].count(total) > 1], "a [total, total] tensor in a decode step"
        assert max(prod(s) for _, s in grown) == present, [g for g in grown if prod(g[1]) > present]
        # 2 presents per layer, and a few [1, 1, 1, total]-sized mask vectors (built once, shared by the layers)
        assert sum(prod(s) for _, s in grown) <= 2 * n * present + 16 * total
    assert not list(tmp_path.iterdir())  # the profiler's traces are removed


def test_greedy_generation_of_the_written_graph_equals_transformers(written):
    generation = written[2]["decoder"]["generation"]
    assert generation["equal"] and generation["prompts"] == 3 and generation["new_tokens"] == 16
    assert generation["provider"] == "CPUExecutionProvider" and generation["tokens_compared"] >= 3
    assert all(0 <= k <= 16 for k in generation["quantized_leading_tokens_equal"])


def test_the_rewrite_finds_every_ffn_matmul_of_the_decoder(written):
    planned, _, result = written
    q = result["quantize"]
    assert sum(q["kinds"].values()) == len(planned.modules) == 6
    assert q["nodes"]["quantized"]["MatMulNBits"] == 3


def test_the_quantized_graph_through_its_cache_scores_as_the_prefill_graph(written, tmp_path):
    """The cached path (half at once, then a token per call) against the same graph at once and against today's
    prefill graph of the same plan (no cache). The same graph's two paths differ by float32 summation order only
    (`_cached_score` checks its logits within the float32 bound). The prefill graph is another graph: a float32
    difference of one unit in front of a static int8 quantizer can move a value across a rounding tie, a whole
    quantization step, so its perplexity agrees within the graph's 0.5% score bound, not a float32 one (seen here:
    2.4e-5 in ln ppl on one CPU against a float32 bound of 1.5e-5, within bound on another)."""
    from ffnquant.deploy.onnx_model import export_float_graph, score_graph
    from ffnquant.deploy.onnx_rewrite import quantize_graph

    planned, _, result = written
    cached, score = result["score"]["cached"], result["score"]
    assert cached["equals_once"] and cached["max_abs_logit_diff"] <= cached["logit_tolerance"]
    assert cached["meets_tolerance"] and abs(cached["perplexity_rel_diff"]) <= 0.005
    assert cached["n_tokens"] == score["onnx"]["n_tokens"]
    prefill = export_float_graph(planned.model, planned.info, tmp_path / "planned.prefill.onnx")
    quantize_graph(prefill, planned, tmp_path / "prefill.onnx")
    old = score_graph(tmp_path / "prefill.onnx", planned)
    assert "cached" not in old  # a prefill graph has no cache to score through
    bound = math.log1p(PPL_TOLERANCE)
    assert abs(np.log(cached["perplexity"] / old["onnx"]["perplexity"])) <= bound
    assert abs(np.log(score["onnx"]["perplexity"] / old["onnx"]["perplexity"])) <= bound


def test_batched_left_padded_generation_equals_each_prompt_alone(written):
    """The loop's mask and positions: left padding changes nothing a row computes (float32 rounding aside, no
    argmax of these prompts lies within it)."""
    from ffnquant.deploy.onnx_decoder import greedy_generate
    from ffnquant.onnx.onnxquant import ort_session

    session = ort_session(written[1] / "model.fp32.onnx")
    prompts = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51], [1, 60, 61, 62, 63]]
    alone = [greedy_generate(session, [p], 12)[0] for p in prompts]
    assert greedy_generate(session, prompts, 12) == alone and all(len(a) == 12 for a in alone)
    # EOS ends a row: the first token generated, taken as EOS, leaves one token
    assert greedy_generate(session, prompts[:1], 12, eos_token_id=alone[0][0]) == [alone[0][:1]]
    with pytest.raises(FFNQuantError):
        greedy_generate(session, [[]], 4)


def test_decode_latency_is_side_by_side_within_the_models_positions(written):
    lat = written[2]["decoder"]["decode_latency"]
    assert set(lat["contexts"]) == {"16", "64"} and lat["beyond_max_positions"] == [1024]
    assert lat["provider"] == "CPUExecutionProvider" and lat["new_tokens"] == 1
    for row in lat["contexts"].values():
        for graph in ("float", "quantized"):
            r = row[graph]
            assert 0 < r["p10_ms"] <= r["p50_ms"] <= r["p90_ms"] and r["samples"] == 3 * 3
            assert r["tokens_per_s"] == pytest.approx(1e3 / r["p50_ms"])
        assert row["speedup"] == pytest.approx(row["float"]["p50_ms"] / row["quantized"]["p50_ms"])


def test_the_folder_has_onnxruntime_genais_config_and_tokenizer(written):
    """genai_config.json names the quantized decoder, its inputs and outputs as the graph has them, and the cache's
    shape; the model's tokenizer files lie beside it."""
    import onnx

    planned, folder, result = written
    cfg = json.loads((folder / "genai_config.json").read_text())["model"]
    dec = cfg["decoder"]
    graph = onnx.load(str(folder / dec["filename"]), load_external_data=False).graph
    names = {v.name for v in graph.input} | {v.name for v in graph.output}
    n = dec["num_hidden_layers"]
    assert dec["filename"] == "model.onnx" and n == planned.float_model.config.num_hidden_layers
    for key in ("past_key_names", "past_value_names"):
        assert {dec["inputs"][key] % i for i in range(n)} <= names
    for key in ("present_key_names", "present_value_names"):
        assert {dec["outputs"][key] % i for i in range(n)} <= names
    assert {dec["inputs"][k] for k in ("input_ids", "attention_mask", "position_ids")} | {"logits"} <= names
    past = next(v for v in graph.input if v.name == dec["inputs"]["past_key_names"] % 0).type.tensor_type.shape.dim
    assert (past[1].dim_value, past[3].dim_value) == (dec["num_key_value_heads"], dec["head_size"])
    assert cfg["type"] == "llama" and cfg["vocab_size"] == planned.float_model.config.vocab_size
    genai = result["decoder"]["genai"]
    assert set(genai["files"]) >= {"genai_config.json", "tokenizer.json"}
    assert all((folder / f).is_file() for f in genai["files"]) and set(genai["files"]) <= set(result["files"])


def test_onnxruntime_genai_generates_what_ffnquants_loop_generates(written):
    """onnxruntime-genai's `og.Model` + `Generator` on the folder: greedy tokens equal to ffnquant's loop on the
    same quantized graph, prompt by prompt (one graph, one arithmetic: equal token for token)."""
    pytest.importorskip("onnxruntime_genai")
    genai = written[2]["decoder"]["genai"]
    assert genai["ran"], genai["reason"]
    assert genai["equal"] and genai["tokens_compared"] > 0, genai["rows"]


def test_the_deploy_document_reports_the_decoder(written):
    from ffnquant.report.deploy import _graph_lines, decoder_summary

    graph = {"status": "ok", **written[2]}
    text = "\n".join(_graph_lines(graph))
    assert "a decoder with a KV cache" in text and "equal token for token" in text
    assert "- attention: one Attention node per layer, opset 23" in text
    assert "Decode latency per token with the cache" in text and "not measured at 1024 tokens" in text
    lines = decoder_summary(graph["decoder"], graph["score"]["cached"])
    assert lines[0].startswith("KV-cache decoder: greedy generation equals") and len(lines) == 3 + 2
    assert lines[1].startswith("onnxruntime-genai")
    assert "prefill graph" in decoder_summary({"status": "refused", "reason": "x"}, None)[0]


def test_a_model_without_a_cache_export_gets_the_prefill_graph_with_the_reason(written, tmp_path, monkeypatch):
    from ffnquant.deploy import onnx_decoder
    from ffnquant.deploy.onnx_model import write_model_graph

    def refuse(model):
        raise FFNQuantError("its cache is MambaCache, not a DynamicCache of per-layer keys and values")

    monkeypatch.setattr(onnx_decoder, "cache_layout", refuse)
    result = write_model_graph(written[0], tmp_path, tokens=(4,), rounds=1)
    assert result["decoder"] == {"status": "refused", "reason": "its cache is MambaCache, not a DynamicCache of "
                                                                 "per-layer keys and values"}
    assert "cached" not in result["score"] and result["score"]["meets_tolerance"]
    assert "cached_logits" not in result["parity"]["float"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.fp32.onnx", "model.onnx"]


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory):
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    from hf_models import save_causal_tiny, tokenizer

    T.logging.set_verbosity_error()
    root, tok, made = tmp_path_factory.mktemp("families"), tokenizer(T), {}

    def folder(model_type):
        if model_type not in made:
            made[model_type] = save_causal_tiny(T, model_type, root / model_type, tok)
        return made[model_type]

    return folder


# the families the graph takes beyond llama (the fixture's): grouped-query and multi-query attention (falcon),
# sliding-window layers (gemma3_text: a 16-token window, passed by the 8 + 16 tokens), EOS mid-way (phi3 stops
# at its EOS on one prompt), a fused gate+up (glm), q/k norms (qwen3)
@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text", "phi3", "glm", "falcon"])
def test_greedy_generation_equals_transformers_across_families(family_folders, model_type, tmp_path):
    from transformers import AutoModelForCausalLM

    from ffnquant.deploy.onnx_decoder import export_decoder, generation_check
    from ffnquant.hf import inspect_model
    from ffnquant.onnx.onnxquant import ort_session

    folder = family_folders(model_type)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    parity = export_decoder(model, inspect_model(folder), tmp_path / "d.onnx", 20)
    assert parity["passed"]
    # falcon's attention did not export at opset 23 before transformers 5.25: then the decomposed graph, saying so
    decomposed = parity["attention_nodes"] == 0
    assert parity["attention_nodes"] == 2 or (model_type == "falcon" and decomposed), parity["attention"]
    assert not decomposed or parity["attention"].startswith("decomposed SDPA: the opset 23 export failed")
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 30, 31, 32, 33, 34, 35, 36], [1, 70, 60, 50, 40, 30, 20, 10]]
    check = generation_check(model, ort_session(tmp_path / "d.onnx"), prompts, 16)
    assert check["equal"], [(r["onnx"], r["transformers"]) for r in check["rows"] if not r["equal"]]


def test_without_onnxruntime_genai_the_files_are_written_and_the_check_says_why(written, monkeypatch):
    from ffnquant.deploy import genai

    monkeypatch.setattr(genai, "genai_unavailable", lambda: "onnxruntime-genai is not importable (x): pip install it")
    out = genai.genai_check(written[1], [{"prompt": [3, 4], "tokens": [5]}], 1)
    assert out == {"ran": False, "reason": "onnxruntime-genai is not importable (x): pip install it"}
    from ffnquant.report.deploy import genai_line

    assert genai_line(out) == "onnxruntime-genai: not run (onnxruntime-genai is not importable (x): pip install it)"


def test_the_serving_benchmark_runs_the_folder_in_genais_loop(written):
    """benchmarks/serve.py's genai row of an exported decoder folder: genai's own loop at 1 and 2 prompts, and the
    quantized operators of the graph genai_config.json names."""
    pytest.importorskip("onnxruntime_genai")
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("serve_benchmark", Path(__file__).resolve().parent.parent
                                                  / "benchmarks" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    args = argparse.Namespace(concurrent=2, new_tokens=4, repeats=1, timeout=300)
    # export writes the graph's result into ffnquant-deploy.json: where each FFN lies in the graph
    deploy = written[1] / "ffnquant-deploy.json"
    deploy.write_text(json.dumps({"graph": written[2]}, default=str))
    try:
        row = serve.genai_one(str(written[1]), args, [[1, 5, 9, 13, 17, 21], [1, 30, 31, 32, 33, 34]])
    finally:
        deploy.unlink()
    assert "error" not in row, row
    assert row["prefill_s"] > 0 and row["decode_tok_s_1"] > 0 and row["decode_tok_s_concurrent"] > 0
    # a profiled request: both FFNs found, a share of each run between 0 and 1, every node named by the graph
    assert row["ffn_layers"] == 2 and 0 < row["ffn_share_decode"] < 1 and 0 < row["ffn_share_prefill"] < 1, row
    assert row["unattributed_share"] == 0.0
    assert row["kernels"] and all(k.split(" x")[0] in {"MatMulNBits", "MatMulInteger", "DynamicQuantizeLinear",
                                                        "QuantizeLinear", "DynamicQuantizeMatMul",
                                                        "MatMulIntegerToFloat", "QLinearMatMul",
                                                        "GatherBlockQuantized"} for k in row["kernels"])


def test_a_graph_that_fixed_its_input_shape_is_named():
    """torch.export may specialise a dimension (a hybrid model's state-space path): such a graph runs on one input
    shape only, so the whole-model export refuses it with the dimension, rather than fail in onnxruntime."""
    from onnx import TensorProto, helper

    from ffnquant.deploy.onnx_model import _fixed_input_dims

    def graph(dims):
        inp = helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims)
        out = helper.make_tensor_value_info("y", TensorProto.INT64, dims)
        return helper.make_model(helper.make_graph([helper.make_node("Identity", ["input_ids"], ["y"])], "g", [inp], [out]))

    assert _fixed_input_dims(graph(["batch", "seq"])) == []
    assert _fixed_input_dims(graph(["batch", 7])) == [("seq", 7)]
    assert _fixed_input_dims(graph([2, 7])) == [("batch", 2), ("seq", 7)]


def test_a_library_error_reaches_the_user_without_terminal_colour_codes():
    from ffnquant.errors import first_line

    assert first_line(RuntimeError("Failed to export. \x1b[96mThis is\x1b[0m a hint\nsecond line")) == \
        "Failed to export. This is a hint"
