"""planning.vllm_latency: the latency table measured in vLLM's CPU build (`plan --runtime vllm-cpu`)."""

from __future__ import annotations

import pytest

from ffnquant.deploy import vllm
from ffnquant.errors import FFNQuantError
from ffnquant.planning import vllm_latency
from ffnquant.planning.target import Objective, Workload
from ffnquant.recipe import Recipe
from ffnquant.spec import FFNSpec, Variant

SPEC = FFNSpec(Variant.SWIGLU, 128, 256)


def test_recipes_that_run_the_same_kernel_share_one_group_and_refusals_keep_vllms_reason():
    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@search", "w8a8@search+smooth", "w8a8@search+smooth+float=hidden",
                                         "w8a8-dynamic-s8", "w4a16-g64-gptq", "w4a16-g64", "w8a16")]
    groups, refused = vllm_latency.kernel_groups(recipes, SPEC)
    assert {g: [str(r) for r in rs] for g, rs in groups.items()} == {
        "fp32": ["fp32"], "w8a8": ["w8a8@search", "w8a8@search+smooth"],
        "w8a8+float=hidden": ["w8a8@search+smooth+float=hidden"], "w8a8-dynamic-s8": ["w8a8-dynamic-s8"],
        "w4a16-g64": ["w4a16-g64-gptq", "w4a16-g64"]}
    assert list(refused) == ["w8a16"] and "uint8b128" in refused["w8a16"]


@pytest.mark.parametrize("runtime, ok", [("vllm-cpu", True), ("vllm-cpu,torch-cpu", False), ("ort-cpu,vllm-cpu", False)],
                         ids=["alone", "with-torch", "with-ort"])
def test_vllm_cpu_is_a_plan_runtime_of_its_own(runtime, ok):
    if ok:
        assert Objective("latency", runtime).runtimes == ("vllm-cpu",)
    else:
        with pytest.raises(FFNQuantError, match="cannot be listed with other runtimes"):
            Objective("latency", runtime)


class _Info:
    spec = SPEC
    layers = [type("L", (), {"index": i})() for i in range(6)]
    path = "unused"


def test_each_group_is_timed_on_its_own_layers_at_the_request(monkeypatch):
    """The table pools a group's layers' samples: a group on layers 0 and 3 gets their prefill and decode calls."""
    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@search", "w8a8@search+smooth", "w4a16-g64")]
    seen = {}

    def folder(info, groups, path):
        seen["groups"] = list(groups)
        return {i: groups[i % len(groups)] for i in range(6)}

    def times(path, tokens, dtype, max_model_len):
        seen["tokens"], seen["dtype"] = list(tokens), dtype
        # layer i's FFN: prefill (i + 1) x 10 ms, decode (i + 1) ms
        return {"modules": [f"model.layers.{i}.mlp" for i in range(6)], "classes": ["LlamaMLP"], "load_s": 1.0,
                "kernels": [], "ms": {"64": [[10.0 * (i + 1)] * 3 for i in range(6)], "1": [[1.0 * (i + 1)] * 5
                                                                                     for i in range(6)]}}

    monkeypatch.setattr(vllm_latency, "vllm_unavailable", lambda: None)
    monkeypatch.setattr(vllm_latency, "_timing_folder", folder)
    monkeypatch.setattr(vllm_latency, "vllm_ffn_times", times)
    table = vllm_latency.measure_vllm_table(_Info(), recipes, Workload(64, 4))
    assert seen == {"groups": ["fp32", "w8a8", "w4a16-g64"], "tokens": [64, 1], "dtype": "bfloat16"}
    # w8a8 on layers 1 and 4: prefill medians of 20 and 50 ms pooled -> 35; decode 2 and 5 -> 3.5
    row = table["w8a8@search"]
    assert row["layers"] == [1, 4] and row["prefill_ms"] == pytest.approx(35.0) and row["decode_ms"] == pytest.approx(3.5)
    assert row["p50_ms"] == pytest.approx(35.0 + 4 * 3.5) and table["w8a8@search+smooth"]["p50_ms"] == row["p50_ms"]
    assert table["fp32"]["layers"] == [0, 3] and table["fp32"]["kernel"] == "float"


def test_without_vllm_a_vllm_plan_is_refused_before_the_model_is_read(monkeypatch, tmp_path):
    from hf_models import write_llama_like

    from ffnquant.hf import inspect_model
    from ffnquant.wholemodel import plan_request

    write_llama_like(tmp_path / "m", d=128, f=256)
    info = inspect_model(tmp_path / "m")
    monkeypatch.setattr(vllm, "vllm_unavailable", lambda: "vLLM is not installed in this environment")
    with pytest.raises(FFNQuantError, match="plan runtime vllm-cpu is not available here: vLLM is not installed"):
        plan_request(info, "ppl+1%", "latency", runtime="vllm-cpu")
    monkeypatch.setattr(vllm, "vllm_unavailable", lambda: None)
    req = plan_request(info, "ppl+1%", "latency", runtime="vllm-cpu", candidates="w8a8,w8a16")
    assert req.serve == "vllm-cpu" and req.format == "compressed-tensors"
    assert [s["recipe"] for s in req.left_out] == ["w8a16"]
    with pytest.raises(FFNQuantError, match="--serve vllm-gpu names another"):
        plan_request(info, "ppl+1%", "latency", runtime="vllm-cpu", serve="vllm-gpu")


needs_vllm = pytest.mark.skipif(vllm.vllm_unavailable() is not None, reason=str(vllm.vllm_unavailable()))


@needs_vllm
def test_vllm_times_each_ffn_of_a_folder(tmp_path):
    """vLLM's own FFN modules of a tiny Llama, timed at a prefill and a decode step: one list of calls per layer."""
    pytest.importorskip("transformers")
    from hf_models import write_vllm_llama

    write_vllm_llama(tmp_path / "src", layers=3)
    got = vllm.vllm_ffn_times(tmp_path / "src", [32, 1], max_model_len=64)
    assert got["modules"] == [f"model.layers.{i}.mlp" for i in range(3)]
    assert set(got["ms"]) == {"32", "1"} and all(len(calls) >= 3 and min(calls) > 0 for calls in got["ms"]["1"])
