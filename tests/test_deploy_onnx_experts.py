"""deploy.onnx_experts: routed experts in the whole-model ONNX graph, one onnxruntime MoE node per experts module in
the float graph and QMoE (the plan's codes) in the quantized one, on tiny Qwen3-MoE (SiLU-GLU experts), gpt-oss
(interleaved gate_up with biases and a clamped gate) and DeepSeek-V3 (a dense first layer, shared experts, a
sigmoid router with a bias); what each node computes found from the module; the recipes and calls refused."""

from __future__ import annotations

import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.measure.latency import REFERENCE_TOLERANCE_DB

from hf_models import tiny_or_skip

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {t: tiny_or_skip(t, root / t) for t in ("qwen3_moe", "gpt_oss", "deepseek_v3")}


def _planned(folder, recipe):
    from ffnquant.deploy import build_planned_model
    from ffnquant.hf import inspect_model
    from ffnquant.planning import Plan
    from ffnquant.planning.planfile import model_fingerprint
    from ffnquant.recipe import Recipe

    info = inspect_model(folder)
    plan = Plan(model_fingerprint(info), {layer.index: Recipe.parse(recipe) for layer in info.layers}, "ppl+1%", "bytes")
    return build_planned_model(info, plan, calib_tokens=256, eval_tokens=128, fmt="onnx")


def _model(folder):
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type,expected", [
    ("qwen3_moe", ("swiglu", 1.0, 0.0, None)),
    ("gpt_oss", ("swiglu", 1.702, 1.0, 7.0)),
], ids=["silu-glu", "gpt-oss-clamped"])
def test_what_the_operator_computes_is_found_from_the_module(folders, model_type, expected):
    from ffnquant.deploy.onnx_experts import experts_op
    from ffnquant.hf import inspect_model

    info = inspect_model(folders[model_type])
    module = next(m for m in _model(folders[model_type]).modules() if type(m).__name__ == info.arch.experts_class)
    op = experts_op(module, info.arch, 2)
    assert (op.activation, op.alpha, op.beta, op.limit) == expected


def test_experts_no_operator_activation_reproduces_are_refused_naming_the_module(folders):
    from ffnquant.deploy.onnx_experts import experts_op
    from ffnquant.hf import inspect_model

    info = inspect_model(folders["qwen3_moe"])
    module = next(m for m in _model(folders["qwen3_moe"]).modules() if type(m).__name__ == info.arch.experts_class)
    module.act_fn = torch.nn.Tanh()
    with pytest.raises(FFNQuantError, match="Qwen3MoeExperts: no activation of onnxruntime's MoE"):
        experts_op(module, info.arch, 2)


def test_a_plans_experts_are_qmoe_nodes_scoring_as_the_torch_reference(folders, tmp_path):
    """Qwen3-MoE at w4a16-g32 through `write_model_graph`: the float graph's MoE nodes, the quantized graph's QMoE
    nodes (4-bit blocks of 32 from the plan's codes), scored against ffnquant's torch reference of the plan."""
    import onnx

    from ffnquant.deploy.onnx_model import write_model_graph

    planned = _planned(folders["qwen3_moe"], "w4a16-g32")
    result = write_model_graph(planned, tmp_path, tokens=(1, 16), rounds=1, contexts=(16,), prompts=1, new_tokens=4)
    experts = result["quantize"]["experts"]
    assert len(experts) == 2 and {(w["op"], w["bits"], w["block_size"]) for w in experts.values()} == {("QMoE", 4, 32)}
    ops = lambda name: [n.op_type for n in onnx.load(str(tmp_path / name)).graph.node]  # noqa: E731
    assert ops("model.fp32.onnx").count("MoE") == 2 and ops("model.onnx").count("QMoE") == 2
    assert "MoE" not in ops("model.onnx")
    score = result["score"]
    # the same codes on both sides: float rounding only, far inside the tolerances every ONNX graph is held to
    assert score["meets_tolerance"] and abs(score["hidden_sqnr_db_diff"]) <= REFERENCE_TOLERANCE_DB
    assert result["decoder"]["status"] == "ok" and score["cached"]["equals_once"]  # through the KV cache too
    from ffnquant.deploy.genai import genai_unavailable

    if genai_unavailable() is None:  # genai knows no qwen3_moe: its generic decoder runs the QMoE graph
        genai = result["decoder"]["genai"]
        assert genai["ran"] and genai["equal"] and genai["type"] == "decoder" and "qwen3_moe" in genai["type_note"]
    assert result["files"]["model.onnx"] < result["files"]["model.fp32.onnx"]


@pytest.mark.parametrize("model_type,recipe", [("deepseek_v3", "w4a16-g32-asym")], ids=["deepseek-asymmetric-blocks"])
def test_other_grids_and_experts_score_as_the_reference(folders, model_type, recipe, tmp_path):
    """4-bit blocks with zero points on DeepSeek-V3 (its router: sigmoid scores with a bias, groups, a scaling
    factor, the model's own graph): the planned export's parity check against torch, then the score. (gpt-oss'
    biased, clamped experts: its activation test above and the architecture matrix's after-run.)"""
    from ffnquant.deploy.onnx_experts import ExpertsInGraph
    from ffnquant.deploy.onnx_model import DEFAULT_OPSET, _export, score_graph
    from ffnquant.deploy.onnx_rewrite import quantize_graph

    planned = _planned(folders[model_type], recipe)
    float_path, path = tmp_path / "planned.fp32.onnx", tmp_path / "model.onnx"
    with ExpertsInGraph(planned.model, planned.info, planned.modules, planned.weight_of) as experts:
        _export(planned.model, planned.info, float_path, DEFAULT_OPSET, planned.evals[0][:1, :64])  # the prefill graph
    written = quantize_graph(float_path, planned, path)
    assert {w["op"] for w in experts.values()} == {"QMoE"}
    # any FFN beside the experts is a MatMul rewrite (DeepSeek's dense layer and shared experts stay float here)
    assert sum(written["kinds"].values()) == sum(1 for m in planned.modules if m.expert is None)
    score = score_graph(path, planned, cached=False)
    assert score["meets_tolerance"] and abs(score["hidden_sqnr_db_diff"]) <= REFERENCE_TOLERANCE_DB


def test_recipes_qmoe_cannot_store_are_left_out_of_an_onnx_plan_with_the_reason(folders):
    from ffnquant.deploy.formats import recipe_refusals
    from ffnquant.hf import inspect_model
    from ffnquant.recipe import Recipe

    info = inspect_model(folders["qwen3_moe"])
    recipes = [Recipe.parse(r) for r in ("fp32", "w4a16-g32", "w8a16", "w8a8-dynamic-s8", "w4a16-g32-hqq")]
    refused = {str(r): why for r, why in recipe_refusals("onnx", info, recipes).items()}
    assert sorted(refused) == ["w4a16-g32-hqq", "w8a8-dynamic-s8"]
    assert "QMoE computes on float activations" in refused["w8a8-dynamic-s8"]
    assert "HQQ's float zero points" in refused["w4a16-g32-hqq"]  # the dense rule says it first


def test_a_plan_quantizing_the_experts_inputs_is_refused_before_the_export(folders, tmp_path):
    from ffnquant.deploy.onnx_model import write_model_graph

    planned = _planned(folders["qwen3_moe"], "w8a8-dynamic-s8")
    with pytest.raises(FFNQuantError, match="QMoE computes on float activations"):
        write_model_graph(planned, tmp_path)
    assert not any(tmp_path.iterdir())
