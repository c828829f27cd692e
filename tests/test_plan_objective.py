"""The plan's latency objective costs the request it serves: a prefill of the prompt plus decode steps of one token
(`target.Workload`); the latency table times each artifact at both sizes (`latency_table.request_row`); the search
never chooses a candidate slower than fp32 on that request, even one faster at prefill."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.planning.latency_table import request_row
from ffnquant.planning.search import Option, solve
from ffnquant.planning.target import DECODE_TOKENS, Objective, Workload


def test_the_objective_names_its_request_and_takes_a_prompt_length():
    assert Objective().tokens == Workload(512, DECODE_TOKENS)
    assert Objective("latency", "ort-cpu", 256).tokens == Workload(256, DECODE_TOKENS)  # an int: the prompt
    assert Objective(tokens=Workload(64, 0)).name == "latency on ort-cpu of a 64-token prefill + 0 decode steps"
    assert Objective("bytes").name == "weight bytes"
    for bad in (0, -3, True, 2.5, "512"):
        with pytest.raises(FFNQuantError, match="objective tokens must be an integer >= 1"):
            Objective(tokens=bad)
    with pytest.raises(FFNQuantError, match="decode tokens must be an integer >= 0"):
        Workload(512, -1)
    assert Workload(100, 3).cost(10.0, 2.0) == 16.0


def test_a_row_is_the_prefill_plus_the_decode_steps():
    row = request_row([90.0, 100.0, 110.0], [1.0, 2.0, 3.0, 2.0], Workload(512, 10))
    assert row["prefill_ms"] == 100.0 and row["decode_ms"] == 2.0
    assert row["p50_ms"] == 100.0 + 10 * 2.0  # what the search minimises
    assert row["p10_ms"] < row["p50_ms"] < row["p90_ms"]
    assert (row["tokens"], row["decode_steps"], row["samples"], row["decode_samples"]) == (512, 10, 3, 4)
    assert request_row([5.0], [0.0], Workload(8, 0))["p50_ms"] == 5.0  # prefill only


# a per-FFN table as measured on a CPU: per-token dynamic int8 faster on a long prompt, slower per token
TIMES = {"fp32": ([100.0], [1.0]), "w8a8-dynamic-s8": ([60.0], [1.5]), "w4a16-g64": ([105.0], [0.4])}
DAMAGE = {"fp32": 0.0, "w8a8-dynamic-s8": 0.001, "w4a16-g64": 0.004}


def _choose(workload: Workload, budget: float, layers: int = 6) -> dict[int, str]:
    costs = {k: request_row(p, d, workload)["p50_ms"] for k, (p, d) in TIMES.items()}
    options = {i: [Option(k, DAMAGE[k] * (1 + i % 3), costs[k]) for k in TIMES] for i in range(layers)}
    return {i: o.name for i, o in solve(options, budget).items()}


@pytest.mark.parametrize("budget", [0.0, 0.002, 0.01, 0.05, 1.0])
def test_a_candidate_slower_than_fp32_on_the_request_is_never_chosen(budget):
    # 512 + 128 steps: fp32 228 ms, dynamic int8 252 ms (slower), w4a16 156.2 ms
    chosen = _choose(Workload(512, 128), budget)
    assert "w8a8-dynamic-s8" not in chosen.values()
    if budget >= 0.05:  # room for 4-bit on every layer
        assert set(chosen.values()) == {"w4a16-g64"}


def test_the_same_table_at_prefill_alone_chooses_the_prefill_winner():
    # the old objective (512 tokens, no decode): dynamic int8 is the cheapest there, and a loose budget takes it
    assert set(_choose(Workload(512, 0), 1.0).values()) == {"w8a8-dynamic-s8"}


def test_the_latency_table_times_prefill_and_decode_side_by_side():
    from ffnquant.model import build
    from ffnquant.planning.latency_table import measure_latency_table
    from ffnquant.recipe import Recipe
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    layer = SimpleNamespace(spec=spec, ffn=build(spec, seed=0), label="L0")
    gen = torch.Generator().manual_seed(0)
    calib, held = torch.randn(256, 32, generator=gen), torch.randn(128, 32, generator=gen)
    recipes = [Recipe.parse(r) for r in ("fp32", "w4a16-g32", "w8a8-dynamic-s8")]
    table = measure_latency_table(layer, recipes, calib, held, tokens=Workload(16, 4), rounds=2, per_round=1)
    for key in ("fp32", "w4a16-g32"):
        row = table[key]
        assert row["samples"] == 2 and row["decode_samples"] == 20  # 10 one-token calls per round
        assert row["p50_ms"] == pytest.approx(row["prefill_ms"] + 4 * row["decode_ms"])
        assert (row["tokens"], row["decode_steps"]) == (16, 4)
    # no onnxruntime artifact computes ffnquant's per-token int8: never timed, so never chosen by latency
    assert "p50_ms" not in table["w8a8-dynamic-s8"] and table["w8a8-dynamic-s8"]["reason"]


def test_recipes_with_the_same_graph_are_timed_once():
    """Two static int8 calibrators make the same graph (other scales, the same operators on the same shapes): one
    timing serves both, so noise cannot rank them apart; weight-only 4-bit is another graph, timed on its own."""
    from ffnquant.model import build
    from ffnquant.planning.latency_table import graph_signature, measure_latency_table
    from ffnquant.recipe import Recipe
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    layer = SimpleNamespace(spec=spec, ffn=build(spec, seed=0), label="L0")
    gen = torch.Generator().manual_seed(0)
    calib, held = torch.randn(256, 32, generator=gen), torch.randn(128, 32, generator=gen)
    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@minmax", "w8a8@search", "w4a16-g32")]
    table = measure_latency_table(layer, recipes, calib, held, tokens=Workload(16, 2), rounds=2, per_round=1)
    assert table["w8a8@search"]["timed_as"] == "w8a8@minmax"
    assert table["w8a8@search"]["p50_ms"] == table["w8a8@minmax"]["p50_ms"]
    assert all("timed_as" not in table[k] for k in ("fp32", "w8a8@minmax", "w4a16-g32"))


def test_the_objective_takes_a_runtime_or_a_list_of_them():
    assert Objective("latency", "Torch-CUDA-Graph, triton-cuda").runtimes == ("torch-cuda-graph", "triton-cuda")
    assert Objective().runtimes == ("ort-cpu",)
    assert Objective("latency", "torch-cpu").name.startswith("latency on torch-cpu of")
    for bad, message in [("tpu", "valid: ort-cpu, torch-cpu"), ("", "plan runtime is empty"),
                         ("ort-cpu,torch-cpu", "cannot be listed"), ("torch-cpu,torch-cpu", "names a runtime twice"),
                         ("triton-cpu", "valid:"), (3, "a name or a comma list")]:
        with pytest.raises(FFNQuantError, match=message):
            Objective("latency", bad)


def test_every_plan_runtime_is_a_registered_runtime():
    from ffnquant.planning.target import PLAN_RUNTIMES
    from ffnquant.runtimes import runtime_names

    # vllm-cpu and genai-cpu are timed where they serve (`planning.vllm_latency`, `planning.genai_latency`), not
    # through a runtime adapter
    assert set(PLAN_RUNTIMES) - {"vllm-cpu", "genai-cpu"} <= set(runtime_names())


def _fake_runtime(device: str, formats: tuple[str, ...]):
    return SimpleNamespace(name=f"fake-{device}", device=device, formats=formats)


@pytest.mark.parametrize("recipe, device, expected", [
    ("fp32", "cpu", ("fp32", "timed as fp32")),
    ("fp32", "cuda", ("bf16", "timed as bf16")),  # a GPU's float baseline is bf16
    ("w8a16", "cuda", ("w8a16", "timed as w8a16")),
    ("w8a8-dynamic-s8+smooth", "cuda", ("w8a8-dynamic-s8", "smooth: other stored values")),
    ("fp8-e4m3@mse", "cuda", ("fp8-e4m3", "@mse: other")),
    ("w8a8@search", "cuda", (None, "has no kernel for w8a8")),
    ("w4a16-g128-gptq", "cuda", ("w4a16-g128", "gptq: other")),  # GPTQ's codes on the same grid: the same kernel
    ("w4a16-g128-awq", "cuda", ("w4a16-g128-asym", "awq: other")),
    ("w4a16-g64-hqq", "cuda", (None, "has no kernel for w4a16-g64-hqq")),
    ("w8a8-dynamic-s8+rotate", "cuda", (None, "online Hadamard")),
    ("w8a16+float=hidden", "cuda", (None, "one format per FFN")),
], ids=lambda v: str(v) if not isinstance(v, tuple) else None)
def test_a_recipe_is_timed_as_the_runtime_kernel_for_its_scheme(recipe, device, expected):
    from ffnquant.planning.runtime_latency import runtime_format
    from ffnquant.recipe import Recipe

    rt = _fake_runtime(device, ("fp32", "bf16", "w8a16", "w8a8-dynamic-s8", "fp8-e4m3", "w4a16-g128", "w4a16-g128-asym"))
    fmt, note = runtime_format(Recipe.parse(recipe), rt)
    assert fmt == expected[0] and expected[1] in note


def test_the_runtime_table_shares_a_kernel_between_recipes_and_says_why_one_is_missing():
    from ffnquant.model import build
    from ffnquant.planning.runtime_latency import check_runtimes, measure_runtime_table
    from ffnquant.recipe import Recipe
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    layer = SimpleNamespace(spec=spec, ffn=build(spec, seed=0), label="L0")
    recipes = [Recipe.parse(r) for r in ("fp32", "w8a16", "w8a8-dynamic-s8", "w8a8-dynamic-s8+smooth", "w8a8@search")]
    runtimes = check_runtimes(["torch-cpu"])
    calls = []
    table = measure_runtime_table(layer, recipes, runtimes, Workload(8, 3), rounds=2, per_round=1,
                                  progress=lambda *a: calls.append(a))
    for key in ("fp32", "w8a16", "w8a8-dynamic-s8"):
        row = table[key]
        assert row["runtime"] == "torch-cpu" and row["samples"] == 2 and row["decode_samples"] == 20
        assert row["p50_ms"] == pytest.approx(row["prefill_ms"] + 3 * row["decode_ms"])
    # the smoothed recipe runs the same kernel: one measurement, the same figures
    assert table["w8a8-dynamic-s8+smooth"]["p50_ms"] == table["w8a8-dynamic-s8"]["p50_ms"]
    assert "smooth: other stored values" in table["w8a8-dynamic-s8+smooth"]["note"]
    assert "p50_ms" not in table["w8a8@search"] and "no kernel for w8a8" in table["w8a8@search"]["reason"]
    assert calls[-1] == ("latency table: timing rounds", 2, 2)


def test_a_runtime_that_is_not_here_is_refused_with_its_reason():
    from ffnquant.planning.runtime_latency import check_runtimes

    if torch.cuda.is_available():
        pytest.skip("checks the refusal where there is no CUDA device")
    with pytest.raises(FFNQuantError, match="plan runtime torch-cuda is not available here: no CUDA device"):
        check_runtimes(["torch-cpu", "torch-cuda"])
