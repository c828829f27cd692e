"""The plan's latency objective costs the request it serves: a prefill of the prompt plus decode steps of one token
(`target.Workload`); the latency table times each artifact at both sizes (`latency_table.request_row`); the search
never chooses a candidate slower than fp32 on that request, even one faster at prefill."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.plan.latency_table import request_row
from ffnquant.plan.search import Option, solve
from ffnquant.plan.target import DECODE_TOKENS, Objective, Workload


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
    from ffnquant.plan.latency_table import measure_latency_table
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
