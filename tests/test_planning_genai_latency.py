"""planning.genai_latency: the latency table measured in onnxruntime-genai's generate loop (`plan --runtime
genai-cpu`): the groups of recipes that write the same graph, each FFN's nodes in the decoder graph, the profile read
per run, and a real table of a tiny Llama timed in genai."""

from __future__ import annotations

import pytest

from ffnquant.deploy import genai
from ffnquant.errors import FFNQuantError
from ffnquant.planning import genai_latency
from ffnquant.planning.target import Objective, Workload
from ffnquant.recipe import Recipe

needs_genai = pytest.mark.skipif(genai.genai_unavailable() is not None, reason=str(genai.genai_unavailable()))


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    """A tiny 4-layer Llama (hidden 128, FFN 256): room for a group on each of up to 4 layers."""
    pytest.importorskip("transformers")
    from hf_models import write_vllm_llama

    return write_vllm_llama(tmp_path_factory.mktemp("genai") / "llama", layers=4)


@pytest.mark.hf
def test_recipes_that_write_the_same_graph_share_one_group(llama4):
    from ffnquant.hf import inspect_model

    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@minmax", "w8a8@search+smooth", "w8a8@search+smooth+float=hidden",
                                         "w8a8-dynamic-s8", "w8a8-dynamic-s8+rotate", "w4a16-g64-gptq", "w4a16-g64")]
    groups, refused = genai_latency.graph_groups(recipes, inspect_model(llama4))
    # a calibrator and smoothing fold into the weights; a float site and a rotation change the graph
    assert {g: [str(r) for r in rs] for g, rs in groups.items()} == {
        "fp32": ["fp32"], "w8a8": ["w8a8@minmax", "w8a8@search+smooth"],
        "w8a8+float=hidden": ["w8a8@search+smooth+float=hidden"], "w8a8-dynamic-s8": ["w8a8-dynamic-s8"],
        "w8a8-dynamic-s8+rotate": ["w8a8-dynamic-s8+rotate"], "w4a16-g64": ["w4a16-g64-gptq", "w4a16-g64"]}
    assert refused == {}


@pytest.mark.parametrize("runtime, ok", [("genai-cpu", True), ("genai-cpu,torch-cpu", False),
                                         ("ort-cpu,genai-cpu", False)], ids=["alone", "with-torch", "with-ort"])
def test_genai_cpu_is_a_plan_runtime_of_its_own(runtime, ok):
    if ok:
        assert Objective("latency", runtime).runtimes == ("genai-cpu",)
    else:
        with pytest.raises(FFNQuantError, match="cannot be listed with other runtimes"):
            Objective("latency", runtime)


def _node(name, inputs, outputs):
    from onnx import helper

    return helper.make_node("Identity", inputs, outputs, name=name)


def test_an_ffn_is_the_nodes_between_its_input_and_its_output():
    """Layer 0's FFN reads `x` and writes `y`: its quantizer, matmuls and activation are in; the norm before it,
    the residual after it and a side branch that reads `x` but never reaches `y` are not."""
    nodes = [_node("norm", ["h"], ["x"]), _node("quant", ["x"], ["q"]), _node("gate", ["q"], ["g"]),
             _node("up", ["q"], ["u"]), _node("act", ["g", "u"], ["a"]), _node("down", ["a"], ["y"]),
             _node("side", ["x"], ["s"]), _node("residual", ["y", "h"], ["h2"])]
    regions = genai_latency.ffn_regions(nodes, {0: (["x"], ["y"])})
    assert regions == {0: {"quant", "gate", "up", "act", "down"}}


def test_an_ffns_bounds_are_what_its_first_matmuls_read_and_its_last_writes():
    rows = [{"index": 3, "weight": w, "tensors": {"input": f"in_{w}", "output": f"out_{w}"}}
            for w in ("w_up", "w_gate", "w_down")]
    assert genai_latency.ffn_bounds(rows) == {3: (["in_w_up", "in_w_gate"], ["out_w_down"])}
    lookup = [_node("norm", ["h"], ["x"]), _node("embed", ["table", "input_ids"], ["h"])]
    lookup[1].op_type = "Gather"
    assert genai_latency.token_lookup(lookup) == "embed"


def _event(name, ts, dur, cat="Node", tokens=None):
    e = {"cat": cat, "name": name if cat != "Node" else f"{name}_kernel_time", "ts": ts, "dur": dur, "args": {}}
    if tokens is not None:
        e["args"]["input_type_shape"] = [{"float": [96, 128]}, {"int64": [1, tokens]}]
    return e


def test_the_profile_is_read_per_run_and_a_prefill_starts_a_request():
    """Two requests (a 4-token prefill and a decode step each): each run's FFN time is its nodes' kernel times, a
    fused node (`<node>/<Fusion>/`) counts where its first node lies, and a node the graph does not name is
    counted apart."""
    events = []
    for r, t0 in enumerate((0, 1000)):
        for k, tokens in enumerate((4, 1)):
            start = t0 + 400 * k
            events += [_event("model_run", start, 300, cat="Session"), _event("embed", start + 1, 5, tokens=tokens),
                       _event("gate", start + 10, 100 * tokens), _event("act/QuickGeluFusion/", start + 120, 20),
                       _event("attn", start + 150, 50), _event("mystery", start + 210, 10)]
    got = genai_latency.profile_samples(events, {0: {"gate", "act"}}, "embed", {"embed", "gate", "act", "attn"})
    assert [(r["request"], r["tokens"], r["ffn"][0]) for r in got["runs"]] == [
        (0, 4, pytest.approx(0.42)), (0, 1, pytest.approx(0.12)), (1, 4, pytest.approx(0.42)), (1, 1, pytest.approx(0.12))]
    # 10 us of 'mystery' in each of 4 runs, of 485 us of node time per prefill and 185 per decode step
    assert got["unattributed_share"] == pytest.approx(4 * 10 / (2 * (485 + 185)))
    assert [r["ms"] for r in got["runs"]] == [pytest.approx(0.3)] * 4


def test_without_genai_a_genai_plan_is_refused_before_the_model_is_read(monkeypatch, tmp_path):
    pytest.importorskip("transformers")
    from hf_models import write_llama_like

    from ffnquant.hf import inspect_model
    from ffnquant.wholemodel import plan_request

    write_llama_like(tmp_path / "m", d=128, f=256)
    info = inspect_model(tmp_path / "m")
    monkeypatch.setattr(genai, "genai_unavailable", lambda: "onnxruntime-genai is not importable (x)")
    with pytest.raises(FFNQuantError, match="plan runtime genai-cpu is not available here: onnxruntime-genai is not"):
        plan_request(info, "ppl+1%", "latency", runtime="genai-cpu")
    monkeypatch.setattr(genai, "genai_unavailable", lambda: None)
    req = plan_request(info, "ppl+1%", "latency", runtime="genai-cpu", candidates="w8a8,w4a16-g64")
    assert req.format == "onnx" and req.serve is None
    for given, words in (({"format": "compressed-tensors"}, "--format compressed-tensors"),
                         ({"serve": "vllm-cpu"}, "--serve vllm-cpu")):
        with pytest.raises(FFNQuantError, match=f"{words} names a compressed-tensors deployment"):
            plan_request(info, "ppl+1%", "latency", runtime="genai-cpu", **given)


@pytest.mark.hf
@needs_genai
def test_genai_times_each_group_on_its_own_layers(llama4):
    """A real table: three graphs on a 4-layer Llama, each timed on its layers in genai's loop at the request's
    prompt; recipes of one group share its row; every FFN node lies between its input and its output."""
    from ffnquant.hf import inspect_model

    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@minmax", "w8a8@search+smooth", "w8a8-dynamic-s8")]
    table = genai_latency.measure_genai_table(inspect_model(llama4), recipes, Workload(32, 8), requests=2,
                                              decode_steps=4)
    assert table["fp32"]["layers"] == [0, 3] and table["w8a8@minmax"]["layers"] == [1]
    assert table["w8a8-dynamic-s8"]["layers"] == [2]
    for name, row in table.items():
        assert row["runtime"] == "genai-cpu" and row["prompt_timed"] == 32, name
        # 2 timed requests: a prefill and 3 decode runs each (the 4th token needs no run), per layer
        per_layer = len(row["layers"])
        assert row["samples"] == 2 * per_layer and row["decode_samples"] == 2 * 3 * per_layer, name
        assert row["prefill_ms"] > 0 and row["decode_ms"] > 0 and row["unattributed_share"] == 0.0
    # one measurement, one row in the table's resolution: the group's other recipes say whose time they share
    assert table["w8a8@search+smooth"]["p50_ms"] == table["w8a8@minmax"]["p50_ms"]
    assert table["w8a8@search+smooth"]["timed_as"] == "w8a8@minmax" and "timed_as" not in table["w8a8@minmax"]
    assert {row["graph"] for row in table.values()} == {"fp32", "w8a8", "w8a8-dynamic-s8"}
    # what the graph writes for each, as plan.md's table shows it
    assert [table[r]["kernel"] for r in ("fp32", "w8a8@minmax", "w8a8-dynamic-s8")] == ["float", "qdq", "dynamic-int8"]
    # per-token int8 quantizes each input with a chain of small operators: more nodes than the float matmuls
    assert table["w8a8-dynamic-s8"]["nodes"] > table["fp32"]["nodes"] == 6


@pytest.mark.hf
@needs_genai
def test_a_run_that_wrote_no_profile_is_said(llama4, monkeypatch):
    from ffnquant.hf import inspect_model

    monkeypatch.setattr(genai_latency, "_profiled_requests", lambda *a, **k: None)
    with pytest.raises(FFNQuantError, match="wrote no profile"):
        genai_latency.measure_genai_table(inspect_model(llama4), [Recipe.parse("fp32")], Workload(32, 8), requests=1,
                                          decode_steps=2)
