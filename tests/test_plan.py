"""`ffnquant plan`: the target grammar, the knapsack search, plan.toml, the model-level sensitivities and the
whole loop on a tiny Llama (2 layers, d_model 32) with its own tokenizer."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path
from dataclasses import replace

import pytest
import torch

from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.planning import Plan, Target, load_plan
from ffnquant.planning.job import final_round
from ffnquant.planning.planfile import model_fingerprint
from ffnquant.planning.search import Option, pareto, solve
from ffnquant.recipe import Recipe

from hf_models import tiny_folders

SMALL = ["--calib-tokens", "256", "--eval-tokens", "128", "--probe-tokens", "128", "--tokens", "16", "--no-progress"]
# a held-out text of a few hundred tokens: shorter than a 4,096-token budget
SHORT_TEXT = Path(__file__).resolve().parents[1] / "ffnquant" / "data" / "evaluation.txt"
CANDIDATES = "fp32,w8a8@search,w8a8-dynamic-s8,w4a16-g32,w8a8@search+float=hidden"


# --- target ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, metric, value, budget", [
    ("ppl+1%", "ppl", 1.0, math.log(1.01)),
    ("PPL + 0.5 %", "ppl", 0.5, math.log(1.005)),
    ("sqnr>=30", "sqnr", 30.0, 1e-3),
    ("sqnr>=20dB", "sqnr", 20.0, 1e-2),
    ("kld<=0.01", "kld", 0.01, 0.01),
    ("KLD <= 2e-3", "kld", 0.002, 0.002),
    # top-1 disagreement ~ 0.4 sqrt(KL): 5% disagreement is (0.05 / 0.4)^2 KL-equivalent nats
    ("top1>=95%", "top1", 95.0, (0.05 / 0.4) ** 2),
], ids=["ppl1", "ppl-spaces", "sqnr30", "sqnr-db", "kld", "kld-exponent", "top1"])
def test_targets_parse_to_their_budget(text, metric, value, budget):
    t = Target.parse(text)
    assert (t.metric, t.value) == (metric, value)
    assert t.budget == pytest.approx(budget)
    assert Target.parse(t.name) == t


@pytest.mark.parametrize("text", ["ppl<1%", "ppl+0%", "sqnr>=0", "latency", "ppl+x%", "kld<=0", "top1>=100%",
                                  "top1>=95"],
                         ids=["wrong-op", "zero", "zero-db", "word", "not-number", "kld-zero", "top1-all",
                              "top1-no-percent"])
def test_bad_targets_say_the_forms(text):
    with pytest.raises(FFNQuantError, match="ppl|sqnr|kld|top1"):
        Target.parse(text)


def test_target_met_and_spent_read_the_measurement():
    t = Target.parse("ppl+1%")
    assert t.met({"perplexity_ratio": 1.0099}) and not t.met({"perplexity_ratio": 1.0101})
    assert t.spent({"perplexity_ratio": 1.01}) == pytest.approx(t.budget)
    s = Target.parse("sqnr>=30")
    assert s.met({"hidden_sqnr_db": 30.0}) and not s.met({"hidden_sqnr_db": 29.9})


@pytest.mark.parametrize("text, measured, met, resolved", [
    # the point meets ppl+1% but the interval's upper end does not: not met, unresolved
    ("ppl+1%", {"perplexity_ratio": 1.006, "perplexity_ratio_ci": [1.002, 1.012], "n_predicted": 10_000}, False, False),
    ("ppl+1%", {"perplexity_ratio": 1.006, "perplexity_ratio_ci": [1.004, 1.008], "n_predicted": 10_000}, True, True),
    ("ppl+1%", {"perplexity_ratio": 1.02, "perplexity_ratio_ci": [1.015, 1.025], "n_predicted": 10_000}, False, True),
    ("kld<=0.01", {"kl": {"mean": 0.008, "ci": [0.006, 0.011]}, "n_predicted": 4_000}, False, False),
    ("kld<=0.01", {"kl": {"mean": 0.008, "ci": [0.007, 0.009]}, "n_predicted": 4_000}, True, True),
    # top1 is judged at the interval's lower end
    ("top1>=95%", {"top1_agreement": 0.96, "top1_agreement_ci": [0.94, 0.98], "n_predicted": 4_000}, False, False),
    ("top1>=95%", {"top1_agreement": 0.97, "top1_agreement_ci": [0.955, 0.985], "n_predicted": 4_000}, True, True),
    # no interval and no KL: judged on the point
    ("ppl+1%", {"perplexity_ratio": 1.005, "perplexity_ratio_ci": None, "n_predicted": 100}, True, True),
    # a single sequence: the tokens as independent units (variance 2 x KL per token); 2 tokens resolve nothing
    ("ppl+1%", {"perplexity_ratio": 1.005, "perplexity_ratio_ci": None, "kl": {"mean": 0.01}, "n_predicted": 2},
     False, False),
    ("ppl+1%", {"perplexity_ratio": 1.005, "perplexity_ratio_ci": None, "kl": {"mean": 1e-4}, "n_predicted": 5000},
     True, True),
], ids=["ppl-unresolved", "ppl-met", "ppl-missed", "kld-unresolved", "kld-met", "top1-unresolved", "top1-met",
        "no-interval", "one-sequence-2-tokens", "one-sequence-5000-tokens"])
def test_targets_are_met_at_the_confidence_bound(text, measured, met, resolved):
    t = Target.parse(text)
    res = t.resolution(measured)
    assert t.met(measured) is met and res["met"] is met and res["resolved"] is resolved
    if not resolved:
        # the half-width shrinks as 1/sqrt(tokens): the tokens needed put the interval's end at the target
        point, (lo, hi) = t.figure(measured)
        half = (hi - lo) / 2
        shrunk = half * math.sqrt(measured["n_predicted"] / res["tokens_needed"])
        assert shrunk == pytest.approx(abs(t.value - point), rel=1e-3)
        assert "would resolve it" in res["words"]


def test_a_text_too_small_to_resolve_the_target_says_so_with_the_tokens_it_needs():
    from ffnquant.commands.plan import unresolved_lines

    t = Target.parse("ppl+1%")
    tiny = {"perplexity_ratio": 1.005, "perplexity_ratio_ci": None, "kl": {"mean": 0.01}, "n_predicted": 2}
    res = t.resolution(tiny)
    assert res["tokens_needed"] > 1000 and "would resolve it" in res["words"]
    final = {"domains": {"prose:evaluation": dict(tiny, resolution=res)}}
    assert unresolved_lines(final, t) == [
        f"not verified: 2 tokens of prose:evaluation cannot resolve ppl+1%; about {res['tokens_needed']:,} held-out "
        "tokens would (a longer --eval-text, more --eval-tokens)"]
    met = dict(final["domains"]["prose:evaluation"], resolution=t.resolution({"perplexity_ratio": 1.0}))
    assert unresolved_lines({"domains": {"prose:evaluation": met}}, t) == []


# --- search ----------------------------------------------------------------------------------

def _brute(layers, budget):
    best = None
    for combo in itertools.product(*[layers[i] for i in sorted(layers)]):
        if sum(o.damage for o in combo) <= budget:
            c = sum(o.cost for o in combo)
            best = c if best is None or c < best else best
    return best


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"seed{s}")
def test_search_finds_the_brute_force_optimum(seed):
    rng = random.Random(seed)
    for _ in range(40):
        layers = {i: [Option(f"c{k}", rng.random() * 0.3, rng.random() * 10) for k in range(rng.randint(1, 4))]
                  for i in range(rng.randint(1, 5))}
        budget = rng.random() * 0.8
        got, best = solve(layers, budget, resolution=4000), _brute(layers, budget)
        if best is None:
            assert got is None
            continue
        assert got is not None  # rounding damages up by < budget/4000 could only flip near-ties
        assert sum(o.damage for o in got.values()) <= budget
        assert sum(o.cost for o in got.values()) == pytest.approx(best)


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"seed{s}")
def test_tied_layers_take_one_candidate_at_the_brute_force_optimum(seed):
    """A compressed-tensors folder stores its routed experts under one recipe: the tied layers choose the same name,
    at the least cost any such choice has (brute force over the choices that agree on the tied layers)."""
    rng = random.Random(seed)
    for _ in range(30):
        names = ["fp32", "a", "b", "c"]
        layers = {i: [Option(n, 0.0 if n == "fp32" else rng.random() * 0.3, 10.0 if n == "fp32" else rng.random() * 10)
                      for n in names] for i in range(4)}
        tied = (0, 2, 3)
        budget = rng.random() * 0.8
        got = solve(layers, budget, resolution=4000, tied=tied)
        best = None
        for combo in itertools.product(*[layers[i] for i in sorted(layers)]):
            if len({combo[i].name for i in tied}) == 1 and sum(o.damage for o in combo) <= budget:
                c = sum(o.cost for o in combo)
                best = c if best is None or c < best else best
        assert best is not None  # fp32 everywhere has no damage
        assert len({got[i].name for i in tied}) == 1 and sorted(got) == [0, 1, 2, 3]
        assert sum(o.damage for o in got.values()) <= budget
        assert sum(o.cost for o in got.values()) == pytest.approx(best)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_several_tied_groups_each_take_one_candidate_at_the_brute_force_optimum(seed):
    """Routed experts' layers and each FFN several layers call are tied groups of their own: each group takes one
    name (groups may differ), at the least cost any such choice has."""
    rng = random.Random(seed)
    names = ["a", "b", "c"]
    layers = {i: [Option(n, rng.uniform(0, 1), rng.uniform(0, 1)) for n in names] for i in range(5)}
    groups = ((0, 3), (1, 4))
    for budget in (0.8, 1.5, 2.5):
        got = solve(layers, budget, resolution=4000, tied=groups)
        feasible = [combo for combo in itertools.product(*(layers[i] for i in range(5)))
                    if all(len({combo[i].name for i in g}) == 1 for g in groups)
                    and sum(o.damage for o in combo) <= budget]
        if not feasible:
            assert got is None
            continue
        assert got is not None and all(len({got[i].name for i in g}) == 1 for g in groups) and sorted(got) == list(range(5))
        assert sum(o.damage for o in got.values()) <= budget
        best = min(sum(o.cost for o in combo) for combo in feasible)
        assert sum(o.cost for o in got.values()) == pytest.approx(best)


def test_tied_groups_that_overlap_are_one():
    from ffnquant.planning.search import tied_groups

    assert tied_groups((0, 2, 3)) == [[0, 2, 3]]
    assert tied_groups(((0, 1), (1, 2), (5, 6), (7,))) == [[0, 1, 2], [5, 6]]
    assert tied_groups(((), (0, 1))) == [[0, 1]] and tied_groups(()) == []


def test_tied_layers_with_no_candidate_in_common_are_one_line():
    with pytest.raises(FFNQuantError, match="layers 0, 1 must take one candidate and have none in common"):
        solve({0: [Option("a", 0, 1)], 1: [Option("b", 0, 1)]}, 1.0, tied=(0, 1))


def test_search_is_not_fooled_by_a_non_convex_front():
    # greedy by benefit per cost takes 'mid' first and then cannot afford 'cheap' on the other layer
    layers = {0: [Option("fp", 0, 10), Option("mid", 0.5, 6), Option("cheap", 1.0, 0)],
              1: [Option("fp", 0, 10), Option("cheap", 0.5, 1)]}
    got = solve(layers, 1.55)  # damages are rounded up to steps of budget/resolution: leave that much slack
    assert {i: o.name for i, o in got.items()} == {0: "cheap", 1: "cheap"}


def test_search_says_infeasible_and_counts_negative_damage_as_zero():
    assert solve({0: [Option("a", 0.2, 1)]}, 0.1) is None
    got = solve({0: [Option("lucky", -0.5, 1), Option("fp", 0, 5)], 1: [Option("b", 0.1, 1), Option("fp", 0, 5)]}, 0.1)
    assert got[0].name == "lucky" and got[1].name == "b"
    assert [o.name for o in pareto([Option("x", 1, 1), Option("y", 2, 2), Option("z", 0, 3)])] == ["x", "z"]


def test_a_zero_budget_allows_no_damage():
    """Budget 0: only the options that predict no damage (it once took one step as 1.0 of damage: any option of
    damage up to 2,000 fit)."""
    layers = {0: [Option("q", 1e-5, 1), Option("fp", 0, 5)], 1: [Option("q", 0.5, 1), Option("fp", 0, 5)]}
    assert {i: o.name for i, o in solve(layers, 0.0).items()} == {0: "fp", 1: "fp"}
    assert solve({0: [Option("q", 1e-5, 1)]}, 0.0) is None


# --- the verification loop's budget ------------------------------------------------------------

def _point(d, met, a=0.8, c=0.05, label="prose"):
    from ffnquant.planning.steering import RoundPoint

    return RoundPoint(d, met, {label: (a * d, a * d + c * math.sqrt(d))})


def test_the_noise_model_recovers_the_slope_and_the_interval_width_of_its_rounds():
    from ffnquant.planning.steering import noise_model

    got = noise_model([_point(0.01, False), _point(0.004, True), _point(0.006, True)])
    assert got["prose"] == (pytest.approx(0.8), pytest.approx(0.05))


def test_before_any_round_the_noise_model_is_the_prior():
    from ffnquant.planning.steering import noise_model

    assert noise_model([], {"prose": 0.1, "code": 0.2}) == {"prose": (1.0, 0.1), "code": (1.0, 0.2)}


@pytest.mark.parametrize("points, prior, expected", [
    # no round, no interval: the budget times AIM
    ([], {"prose": 0.0}, 0.95),
    # no round, an interval of width c sqrt(D): D + c sqrt(D) = 0.95 (c = 0.5: sqrt(D) = (-0.5 + sqrt(0.25 + 3.8)) / 2)
    ([], {"prose": 0.5}, ((-0.5 + math.sqrt(0.25 + 3.8)) / 2) ** 2),
    # the tightest domain decides
    ([], {"prose": 0.0, "code": 0.5}, ((-0.5 + math.sqrt(0.25 + 3.8)) / 2) ** 2),
    # met with room and no interval: toward the budget, at most UP_STEP (1.5x) the damage that met
    ([_point(0.1, True, a=1.0, c=0.0)], None, 0.15),
    ([_point(0.7, True, a=1.0, c=0.0)], None, 0.95),
    # a float plan met (no damage): no cap from it, toward the budget
    ([_point(0.0, True, a=1.0, c=0.0)], None, 0.95),
    # met close to the goal: settled
    ([_point(0.93, True, a=1.0, c=0.0)], None, None),
    # missed by 2x with nothing met: where the fitted line reaches the goal
    ([_point(1.0, False, a=2.0, c=0.0)], None, 0.475),
    # the model asks past a damage that missed: halfway (geometrically) between met and missed
    ([_point(0.2, True, a=0.5, c=0.0), _point(0.8, False, a=0.5, c=0.0)], None, 0.4),
    # between a damage that met and one that missed, too close to split: settled
    ([_point(0.5, True, a=1.0, c=0.0), _point(0.54, False, a=1.0, c=0.5)], None, None),
], ids=["no-interval", "interval", "worst-domain", "loosen-capped", "loosen-to-goal", "float-met-uncapped",
        "settled", "tighten-by-fit",
        "bisect", "bracketed-settled"])
def test_next_damage_budget(points, prior, expected):
    from ffnquant.planning.steering import next_budget

    got = next_budget(points, 1.0, prior)
    assert got == (pytest.approx(expected) if expected is not None else None)


def test_the_first_rounds_interval_width_grows_with_the_measured_scatter_and_shrinks_with_tokens():
    from ffnquant.planning.steering import first_noise
    from ffnquant.planning.target import Target

    ppl = Target.parse("ppl+1%")
    assert first_noise(ppl, None, {"a": 4096})["a"] == pytest.approx(2 * math.sqrt(2 / 4096))
    assert first_noise(ppl, 8.0, {"a": 4096})["a"] == pytest.approx(2 * math.sqrt(8 / 4096))
    assert first_noise(ppl, 8.0, {"a": 16384})["a"] == pytest.approx(first_noise(ppl, 8.0, {"a": 4096})["a"] / 2)
    assert first_noise(Target.parse("sqnr>=30"), 8.0, {"a": 4096}) == {"a": 0.0}


# --- plan.toml -------------------------------------------------------------------------------

class _Info:
    model_type, n_layers = "llama", 3

    @staticmethod
    def shared_groups():  # no FFN called by several layers
        return ()

    @staticmethod
    def calls_differ():
        return False

    class spec:
        d_model, d_ff = 64, 128

        class variant:
            value = "swiglu"


def _plan():
    return Plan(model_fingerprint(_Info), {0: Recipe.parse("w8a8@search+smooth"), 1: Recipe.parse("fp32"),
                                           2: Recipe.parse("w4a16-g32+float=hidden")}, "ppl+1%", "latency")


def test_plan_round_trips_through_toml(tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text(_plan().to_toml("ffnquant plan --model m"))
    assert load_plan(p).layers == _plan().layers
    assert load_plan(p, _Info).target == "ppl+1%"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('n_layers = 3', 'n_layers = 4'), "another model: n_layers 4"),
    (lambda t: t.replace('d_model = 64', 'd_model = 96'), "d_model 96"),
    (lambda t: t.replace('"w8a8@search+smooth"', '"w9a9"'), "layer 0"),
    (lambda t: t.replace('index = 2', 'index = 7'), "not a layer index"),
    (lambda t: t.replace('index = 2', 'index = 0'), "given twice"),
    (lambda t: t.replace('version = 1', 'version = 9'), "version 9"),
    (lambda t: t + "\n[extra]\nx = 1\n", "unknown key"),
    (lambda t: t.replace("[model]", "[model"), "not valid TOML"),
], ids=["layers", "width", "recipe", "index", "twice", "version", "unknown", "toml"])
def test_a_bad_or_foreign_plan_is_one_line(edit, message, tmp_path):
    p = tmp_path / "plan.toml"
    p.write_text(edit(_plan().to_toml()))
    with pytest.raises(FFNQuantError, match=message) as info:
        load_plan(p, _Info)
    assert "\n" not in str(info.value)


# --- on a tiny trained-shaped model ----------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {name: found[0] for name, found in tiny_folders(tmp_path_factory, ("llama", "bert")).items()}


@pytest.mark.hf
def test_ablations_and_gradients_are_exact_for_the_float_model(tiny):
    """Through the engine (`planning.source.PlanSource`): a layer's ablation with ffnquant's float FFN (the model's own)
    changes nothing, and one pushed along the loss gradient at its output moves the loss by the gradient's first
    order prediction."""
    from ffnquant.hf import EvalSettings, inspect_model
    from ffnquant.planning.source import PlanSource

    info = inspect_model(tiny["llama"])
    settings = EvalSettings(seq_len=16, batch_size=4, max_calib_tokens=128, max_eval_tokens=64, ablation=False)
    eps = 1e-3
    with PlanSource(info, settings, None, None, 64, resident=True, spill=False, progress=None, timings={}) as source:
        assert source.n_probe == 64  # one batch: the push below is that batch's gradient, token for token
        for group in source.groups():
            for layer, _, _, grad in group:
                source.ablate(layer, "float", layer.ffn)
                if layer.index == 1:
                    g = grad[:64]
                    first_order = eps * float(g.double().square().sum())
                    source.ablate(layer, "pushed", lambda x, f=layer.ffn, g=g: f(x) + eps * g.reshape(x.shape))
        ablations = source.ablations
    for i in range(info.n_layers):
        a = ablations[(i, "float")]
        assert a.kl == pytest.approx(0, abs=1e-9) and a.hidden_noise == pytest.approx(0, abs=1e-9)
    pushed = ablations[(1, "pushed")]
    assert pushed.nll_delta == pytest.approx(first_order / pushed.tokens, rel=0.05)


@pytest.mark.hf
def test_plan_meets_its_target_and_quantize_applies_it(tiny, tmp_path, capsys):
    out = tmp_path / "plan"
    rc = main(["plan", "--model", str(tiny["llama"]), "--target", "ppl+1%", "--candidates", CANDIDATES,
               "--out", str(out), *SMALL, "--eval-text", str(SHORT_TEXT), "--eval-tokens", "4096", "--device", "cpu"])
    assert rc == 0
    data = json.loads((out / "plan.json").read_text())
    assert data["device"] == "cpu"  # --device: the engine computed there (the path a GPU takes, each move a no-op)
    # the held-out text gave fewer tokens than asked: the terminal says so, not only plan.md
    short = [b for b in data["token_budgets"].values() if b and b.get("short")]
    printed = capsys.readouterr().out
    assert short and all(f"note: {b['note']}" in printed for b in short)
    final = final_round(data)
    assert data["verified"] and final["met"]
    assert final["end_to_end"]["perplexity_ratio"] <= 1.01
    # the plan never costs more than fp32 everywhere, which always meets the target
    assert final["cost"] <= data["fp32_cost"] + 1e-12
    # every candidate was scored on every layer, dynamic int8 has no ORT artifact and says why
    for layer in data["layers"].values():
        names = {r["recipe"]: r for r in layer["candidates"]}
        assert set(names) == set(CANDIDATES.split(","))
        assert "per tensor" in names["w8a8-dynamic-s8"]["excluded"]
        assert names["fp32"]["predicted_kl"] == 0
    assert "## Verification rounds" in (out / "plan.md").read_text()
    # no chosen static int8 recipe scores below onnxruntime's own best quantizer on its layer
    for index, layer in data["layers"].items():
        chosen = next(r for r in layer["candidates"] if r["recipe"] == final["layers"][index])
        if layer["ort_best"] and Recipe.parse(chosen["recipe"]).resolve().static_activations:
            assert chosen["layer_sqnr_db"] >= layer["ort_best"]["sqnr_db"]
    # the layer atlas with the plan drawn over it: each layer's sites carry the recipe it got
    atlas = json.loads((out / "atlas" / "atlas.json").read_text())
    assert (out / "atlas" / "atlas_ranges.png").stat().st_size > 0
    for index, text in final["layers"].items():
        recipe = Recipe.parse(text)
        for site in ("input", "hidden"):
            floats = recipe.is_float or recipe.keep_float == site
            assert atlas["plan"][str(index)][site] == ("float" if floats else str(replace(recipe, keep_float=None)))
    plan = load_plan(out / "plan.toml")
    assert set(plan.layers) == {0, 1}
    # quantize applies the plan: each layer with its own recipe, the end to end measured again
    rep = tmp_path / "rep"
    assert main(["quantize", "--model", str(tiny["llama"]), "--plan", str(out / "plan.toml"), "--no-onnx",
                 "--calib-tokens", "256", "--eval-tokens", "128", "--out-reports", str(rep), "--no-progress"]) == 0
    q = json.loads(next(rep.glob("quantize_*.plan-plan.json")).read_text())
    assert [r["recipe"] for r in q["layers"]] == [str(plan.layers[0]), str(plan.layers[1])]


@pytest.mark.hf
@pytest.mark.parametrize("args, message", [
    (["--target", "ppl<1%"], "ppl+P%"),
    (["--candidates", "w9a9"], "w9a9"),
    (["--objective", "speed"], "invalid choice"),
    (["--max-memory", "1MB"], "over the 1.0 MB memory budget"),  # refused with the numbers before any work
    (["--runtime", "tpu"], "valid: ort-cpu, torch-cpu"),
    (["--runtime", "ort-cpu,torch-cpu"], "cannot be listed with other runtimes"),
    (["--objective", "bytes", "--runtime", "torch-cpu"], "runtime torch-cpu applies to the latency objective"),
], ids=["target", "candidate", "objective", "memory", "runtime-unknown", "runtime-mixed", "runtime-with-bytes"])
def test_plan_refuses_bad_input_in_one_line(tiny, tmp_path, capsys, args, message):
    out = tmp_path / "plan"
    assert main(["plan", "--model", str(tiny["llama"]), "--out", str(out), *args, *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.hf
def test_plan_refuses_an_encoder_and_quantize_a_foreign_plan(tiny, tmp_path, capsys):
    assert main(["plan", "--model", str(tiny["bert"]), "--out", str(tmp_path / "p"), *SMALL]) == 2
    assert "causal LM" in capsys.readouterr().err
    p = tmp_path / "plan.toml"
    p.write_text(_plan().to_toml())
    assert main(["quantize", "--model", str(tiny["llama"]), "--plan", str(p), "--out-reports", str(tmp_path / "r")]) == 2
    assert "another model" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.fixture(scope="module")
def planned(tiny, tmp_path_factory):
    """A hand-written plan for the tiny Llama: a float site on L0, 4-bit weights on L1."""
    from ffnquant.hf import inspect_model

    info = inspect_model(tiny["llama"])
    path = tmp_path_factory.mktemp("plan") / "plan.toml"
    path.write_text(Plan(model_fingerprint(info), {0: Recipe.parse("w8a8@search+float=hidden"),
                                                   1: Recipe.parse("w4a16-g32")}, "ppl+1%", "latency").to_toml())
    return path


@pytest.mark.hf
def test_export_writes_the_planned_artifacts_and_a_manifest(tiny, planned, tmp_path, monkeypatch, capsys):
    from ffnquant.deploy import onnx_model

    graphs = []

    def write_model_graph(model, folder):  # the whole-model graph itself: tests/test_deploy_onnx_model.py
        graphs.append(model)
        (folder / "model.onnx").write_bytes(b"graph")
        return {"files": {"model.onnx": 5}}

    monkeypatch.setattr(onnx_model, "write_model_graph", write_model_graph)
    out = tmp_path / "exp"
    assert main(["export", "--model", str(tiny["llama"]), "--plan", str(planned), "--out", str(out),
                 "--calib-tokens", "256", "--eval-text", str(SHORT_TEXT), "--eval-tokens", "4096"]) == 0
    # the held-out text gave fewer tokens than the 4,096 asked: the terminal says how many were used
    printed = capsys.readouterr().out
    budget = json.loads((out / "ffnquant-deploy.json").read_text())["token_budgets"]["evaluation"]
    assert budget["short"] and budget["obtained"] < 4096 and f"note: {budget['note']}" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    rows = {m["label"]: m for m in manifest["layers"]}
    assert rows["L0"]["recipe"] == "w8a8@search+float=hidden" and rows["L1"]["recipe"] == "w4a16-g32"
    for m in rows.values():
        assert (out / m["file"]).is_file() and m["file"].startswith(f"llama.{m['label']}.")
        # the artifact computes the reference: same grids, float accumulation order only
        assert abs(m.get("sqnr_db_onnx_graph", m["sqnr_db_onnx"]) - m["sqnr_db_torch"]) < 0.5
        assert ("sqnr_db_onnx_graph" in m) == ("saturate" in m.get("int8_kernel", ""))  # ortcpu says why
    assert manifest["end_to_end"]["status"] == "ok"
    # and the whole model as one graph, of the planned model the manifest describes
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    assert [str(m) for m in graphs[0].plan.layers.values()] == ["w8a8@search+float=hidden", "w4a16-g32"]
    assert doc["graph"]["status"] == "ok" and (out / "model.onnx").read_bytes() == b"graph"


@pytest.mark.hf
def test_run_measures_the_plan_beside_the_single_recipes(tiny, planned, tmp_path):
    out = tmp_path / "run"
    # one synthetic variant beside the model, torch figures only: the plan's row is the model's end to end
    assert main(["run", "--tiny", "--variants", "swiglu", "--no-onnx", "--model", str(tiny["llama"]), "--plan",
                 str(planned), "--runtimes", "none", "--out", str(out), "--export", str(tmp_path / "exp")]) == 0
    doc = json.loads((out / "report.json").read_text())
    rows = doc["model"]["end_to_end"]["schemes"]
    plan_row = next(r for r in rows if r["scheme"].startswith("plan: "))
    assert plan_row["plan"] == {"0": "w8a8@search+float=hidden", "1": "w4a16-g32"}
    assert plan_row["end_to_end"]["hidden_sqnr_db"] > 10
    assert "plan" in (out / "run.toml").read_text()


@pytest.mark.hf
def test_export_and_run_refuse_a_plan_without_its_model(tiny, planned, tmp_path, capsys):
    assert main(["export", "--plan", str(planned), "--out", str(tmp_path / "e")]) == 2
    assert "--model and --plan" in capsys.readouterr().err
    assert main(["run", "--tiny", "--plan", str(planned), "--out", str(tmp_path / "r")]) == 2
    assert "give model too" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "r").exists()


# --- candidates ------------------------------------------------------------------------------

def test_candidate_sets_start_with_fp32_and_a_list_is_checked():
    from ffnquant.planning.candidates import CANDIDATE_SETS, candidate_recipes
    from ffnquant.spec import FFNSpec

    spec = FFNSpec("swiglu", d_model=64)
    for name in CANDIDATE_SETS:
        recipes, skipped = candidate_recipes(name, spec)
        assert recipes[0] == Recipe("fp32") and len(set(recipes)) == len(recipes)
    recipes, _ = candidate_recipes("w8a8@search, w4a16-g32", spec)
    assert [str(r) for r in recipes] == ["fp32", "w8a8@search", "w4a16-g32"]
    with pytest.raises(FFNQuantError, match="w9a9"):
        candidate_recipes("w8a8,w9a9", spec)  # a list the user typed is never silently shortened
    with pytest.raises(FFNQuantError, match="no candidates"):
        candidate_recipes(" , ", spec)


@pytest.mark.parametrize("d_model, d_ff, group", [(640, 2048, 128), (576, 1536, 64), (96, 224, 32), (100, 300, 128)],
                         ids=["gemma3-270m-g128", "smollm2-135m-g64", "g32", "none-divides-as-listed"])
def test_a_sets_4bit_recipes_take_the_largest_group_that_divides_both_widths(d_model, d_ff, group):
    """A group that divides neither width pads it (SmolLM2's 576 in groups of 128 is 640 columns) and servers with
    whole-group kernels refuse it; a set offers its 4-bit recipes at the largest group of 128/64/32 dividing both,
    keeping method and transforms. A list the user typed is taken as written."""
    from ffnquant.planning.candidates import candidate_recipes
    from ffnquant.spec import FFNSpec

    spec = FFNSpec("swiglu", d_model=d_model, d_ff=d_ff)
    four_bit = [str(r) for r in candidate_recipes("default", spec)[0] if r.scheme.startswith("w4")]
    assert four_bit == [f"w4a16-g{group}", f"w4a16-g{group}-gptq", f"w4a16-g{group}-awq",
                        f"w4a16-g{group}-awq+float=hidden"]
    assert [str(r) for r in candidate_recipes("w4a16-g128", spec)[0]] == ["fp32", "w4a16-g128"]


@pytest.mark.parametrize("search_db, held_db, expected", [
    (30.0, 30.0, 1.0), (30.0, 27.0, 10 ** 0.3), (40.0, 10.0, 100.0), (20.0, 40.0, 0.25),
], ids=["same", "3db-worse-held-out", "capped-high", "capped-low"])
def test_generalization_scales_by_the_held_out_loss_of_sqnr(search_db, held_db, expected):
    from ffnquant.planning.candidates import CandidateScore, generalization

    score = CandidateScore("w8a8", layer_sqnr_db=held_db, search_sqnr_db=search_db)
    assert generalization(score) == pytest.approx(expected)


def test_worst_domain_is_judged_at_the_bound():
    from ffnquant.planning.job import worst_domain

    domains = {"prose": {"perplexity_ratio": 1.004, "perplexity_ratio_ci": [1.001, 1.012]},
               "code": {"perplexity_ratio": 1.008, "perplexity_ratio_ci": [1.007, 1.009]}}
    # code's point is worse, prose's interval reaches further: the bound decides
    assert worst_domain(Target.parse("ppl+1%"), domains) == "prose"
    top1 = {"a": {"top1_agreement": 0.97, "top1_agreement_ci": [0.95, 0.99]},
            "b": {"top1_agreement": 0.96, "top1_agreement_ci": [0.955, 0.965]}}
    assert worst_domain(Target.parse("top1>=90%"), top1) == "a"


@pytest.mark.hf
def test_plan_holds_its_target_on_every_held_out_domain(tiny, tmp_path):
    prose, code = tmp_path / "prose.txt", tmp_path / "code.txt"
    from ffnquant.hf.capture import default_text_path

    prose.write_text(default_text_path("evaluation").read_text())
    code.write_text(default_text_path("code").read_text())
    out = tmp_path / "plan"
    assert main(["plan", "--model", str(tiny["llama"]), "--target", "ppl+3%", "--objective", "bytes",
                 "--candidates", "fp32,w4a16-g32", "--eval-text", str(prose), "--eval-text", str(code),
                 "--out", str(out), *SMALL]) == 0
    data = json.loads((out / "plan.json").read_text())
    final = final_round(data)
    assert set(final["domains"]) == {str(prose), str(code)}
    target = Target.parse("ppl+3%")
    for fig in final["domains"].values():
        lo, hi = fig["perplexity_ratio_ci"]
        assert lo <= fig["perplexity_ratio"] <= hi
        assert fig["kl"]["mean"] >= 0 and 0 <= fig["top1_agreement"] <= 1
        assert fig["resolution"]["met"] == target.met(fig)
    # met on all, each at its bound; the worst domain steers the budget
    assert final["met"] == all(target.met(f) for f in final["domains"].values())
    assert final["end_to_end"] == {k: v for k, v in final["domains"][final["worst_domain"]].items() if k != "resolution"}
    md = (out / "plan.md").read_text()
    assert str(prose) in md and str(code) in md and "95% CI" in md


@pytest.mark.hf
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_a_gpu_runtime_without_a_gpu_is_refused_before_any_work(tiny, tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--model", str(tiny["llama"]), "--runtime", "torch-cuda-graph", "--out", str(out), *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert "plan runtime torch-cuda-graph is not available here: no CUDA device" in err and len(err.splitlines()) == 1
    assert not out.exists()


@pytest.mark.hf
def test_plan_times_its_candidates_on_a_torch_runtime(tiny, tmp_path):
    """--runtime torch-cpu: every candidate timed on torch's kernel for its scheme; a scheme without one (static
    uint8 w8a8) is listed with the reason and never chosen; the plan says where it was timed."""
    out = tmp_path / "plan"
    assert main(["plan", "--model", str(tiny["llama"]), "--target", "ppl+3%", "--runtime", "torch-cpu",
                 "--candidates", "fp32,w8a16,w8a8-dynamic-s8,w8a8@search", "--decode-tokens", "2", "--out", str(out),
                 *SMALL]) == 0
    data = json.loads((out / "plan.json").read_text())
    table = data["latency_table"]
    for key in ("fp32", "w8a16", "w8a8-dynamic-s8"):
        assert table[key]["runtime"] == "torch-cpu" and table[key]["p50_ms"] > 0, key
        assert table[key]["p50_ms"] == pytest.approx(table[key]["prefill_ms"] + 2 * table[key]["decode_ms"])
    assert "torch-cpu has no kernel for w8a8" in table["w8a8@search"]["reason"]
    assert "w8a8@search" not in {str(r) for r in load_plan(out / "plan.toml").layers.values()}
    assert data["plan"]["objective"].startswith("latency on torch-cpu of a 16-token prefill + 2 decode steps")
    md = (out / "plan.md").read_text()
    section = md.split("## Latency table")[1]
    assert "| decode step p50 ms | runtime | kernel | note |" in section and "torch-cpu has no kernel for w8a8" in section


# --- --out follows export's rules: a new folder, or --force over what an earlier plan listed ------------------------
_OWN = b"# my own notes on this model, not ffnquant's\n"


@pytest.mark.hf
@pytest.mark.parametrize("layout, force, message", [
    ({"plan.md": _OWN}, False, "exists and is not empty; give another --out or --force"),
    ({"plan.md": _OWN}, True, "also holds plan.md (it holds no plan.json of an earlier ffnquant command)"),
    ({"plan.json": json.dumps({"files": ["plan.json", "plan.toml"]}).encode(), "plan.toml": b"", "plan.md": _OWN}, True,
     "also holds plan.md (not listed in its plan.json)"),
], ids=["user-plan-md", "user-plan-md-force", "earlier-plan-plus-user-file-force"])
def test_plan_never_replaces_a_users_file(tiny, tmp_path, capsys, layout, force, message):
    out = tmp_path / "plan"
    out.mkdir()
    for name, data in layout.items():
        (out / name).write_bytes(data)
    rc = main(["plan", "--model", str(tiny["llama"]), "--out", str(out), *SMALL, *(["--force"] if force else [])])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1
    assert {p.name: p.read_bytes() for p in out.iterdir()} == layout  # as it was
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]  # no staging folder beside it


@pytest.mark.hf
def test_plan_force_replaces_only_what_an_earlier_plan_listed(tiny, tmp_path, capsys):
    out = tmp_path / "reports" / "plan"  # its parent is made too
    args = ["plan", "--model", str(tiny["llama"]), "--out", str(out), "--candidates", "fp32,w8a16", "--objective",
            "bytes", "--target", "ppl+5%", "--rounds", "1", *SMALL]
    assert main(args) == 0
    listed = json.loads((out / "plan.json").read_text())["files"]
    assert {"plan.json", "plan.toml", "plan.md", "atlas/atlas.md"} <= set(listed)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == listed
    capsys.readouterr()
    assert main(args) == 2  # a second plan over the first needs --force
    assert "exists and is not empty" in capsys.readouterr().err
    (out / "plan.toml").write_text("# stale\n")
    assert main(args + ["--force"]) == 0
    assert (out / "plan.toml").read_text() != "# stale\n"
    assert sorted(p.name for p in (tmp_path / "reports").iterdir()) == ["plan"]


@pytest.mark.hf
def test_a_held_out_text_too_small_to_verify_is_refused_with_the_tokens_needed(tiny, tmp_path, capsys):
    """Three words of held-out text once made a plan 'verified'; now it is refused before any work, naming the
    tokens it has and the tokens a verification needs."""
    short = tmp_path / "short.txt"
    short.write_text("Hello there friend")
    out = tmp_path / "plan"
    assert main(["plan", "--model", str(tiny["llama"]), "--eval-text", str(short), "--out", str(out), *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert re.search(r"not verified: \d tokens of .*short\.txt cannot resolve ppl\+1%; at least \d+ are needed", err)
    assert len(err.splitlines()) == 1 and not out.exists()


# --- what the plan leaves unscored, and the onnxruntime floor measured where it matters ----------

def test_never_chosen_leaves_out_what_fp32_beats_and_what_was_not_timed():
    from ffnquant.planning.job import never_chosen

    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@minmax", "w8a16", "w4a16-g128", "w8a8-dynamic-s8")]
    latency = {"fp32": {"p50_ms": 10.0}, "w8a8@minmax": {"p50_ms": 6.0}, "w8a16": {"p50_ms": 12.0},
               "w4a16-g128": {"p50_ms": 10.0}, "w8a8-dynamic-s8": {"p50_ms": None, "reason": "no per-token QDQ"}}
    out = never_chosen(recipes, latency, "ort-cpu")
    assert set(out) == {"w8a16", "w4a16-g128", "w8a8-dynamic-s8"}  # as fast as fp32 is not faster: left out too
    assert "12.00 ms against 10.00 ms" in out["w8a16"] and out["w8a8-dynamic-s8"] == "no per-token QDQ"


@pytest.mark.parametrize("rel_se, kept", [(None, {"w8a8@minmax", "w8a8@search"}), (0.05, {"w8a8@minmax"})],
                         ids=["no-spread-min-gain-1pct", "table-resolution-10pct"])
def test_never_chosen_leaves_out_what_is_not_measurably_faster_than_fp32(rel_se, kept):
    """A candidate faster than fp32 by less than the table resolves (`steering.min_gain`: twice the median relative
    standard error, at least 1%) is not known to be faster: noise must not decide whether it is scored."""
    from ffnquant.planning.rows import never_chosen
    from ffnquant.planning.steering import min_gain

    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@minmax", "w8a8@search", "w4a16-g128")]
    # 20% faster, 5% faster, 0.5% faster
    latency = {"fp32": {"p50_ms": 10.0}, "w8a8@minmax": {"p50_ms": 8.0}, "w8a8@search": {"p50_ms": 9.5},
               "w4a16-g128": {"p50_ms": 9.95}}
    for row in latency.values():
        row["median_rel_se"] = rel_se
    assert min_gain(latency) == pytest.approx(0.01 if rel_se is None else 2 * rel_se)
    out = never_chosen(recipes, latency, "ort-cpu")
    assert {str(r) for r in recipes if not r.is_float} - set(out) == kept
    assert "not measurably faster than fp32 on ort-cpu (9.95 ms against 10.00 ms: 0.5% less" in out["w4a16-g128"]


def test_a_noisy_fp32_row_resolves_less_than_the_table():
    """Gemma 3's table in one run: fp32's median 59.3 ms with an 11.4% standard error, the 4-bit recipes' 49.6 ms
    with 3.1%; 16% less than fp32 passed the table's 12.7% resolution, yet the two medians are 1.4 standard errors
    of their difference apart: not measurably faster, so its GPTQ and AWQ variants are not scored."""
    from ffnquant.planning.rows import never_chosen

    recipes = [Recipe.parse(r) for r in ("fp32", "w4a16-g128", "w8a8@minmax")]
    latency = {"fp32": {"p50_ms": 59.29, "median_rel_se": 0.114}, "w4a16-g128": {"p50_ms": 49.64, "median_rel_se": 0.031},
               "w8a8@minmax": {"p50_ms": 24.71, "median_rel_se": 0.065}}
    for name in ("a", "b", "c"):  # the rest of the table: its median error sets the table's resolution to 12.7%
        latency[name] = {"p50_ms": 30.0, "median_rel_se": 0.0635}
    out = never_chosen(recipes, latency, "ort-cpu")
    assert set(out) == {"w4a16-g128"} and "16.3% less, within the table's resolution of 23.4%" in out["w4a16-g128"]


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"seed{s}")
def test_the_lazy_onnxruntime_floor_finds_the_eager_optimum(seed):
    from ffnquant.planning.floor import FloorSearch, ort_exclude

    rng = random.Random(seed)
    names = ["fp32", "w8a8@minmax", "w8a8@search", "w8a8-dynamic-s8"]
    recipes = [Recipe.parse(n) for n in names]
    rows = {i: [{"recipe": n, "layer_sqnr_db": 0.0 if n == "fp32" else rng.uniform(15, 35)} for n in names]
            for i in range(5)}
    floors = {i: {"method": "minmax", "sqnr_db": rng.uniform(15, 35)} for i in range(5)}
    costs = {"fp32": 10.0, "w8a8@minmax": 5.0, "w8a8@search": 5.5, "w8a8-dynamic-s8": 7.0}

    def options(table):
        return {i: [Option(r["recipe"], 0.0 if r["recipe"] == "fp32" else 10 ** (-r["layer_sqnr_db"] / 10),
                           costs[r["recipe"]]) for r in table[i] if "excluded" not in r] for i in table}

    eager = {i: [dict(r) for r in rows[i]] for i in rows}
    for i in eager:
        ort_exclude(floors[i], recipes, eager[i])
    lazy_rows = {i: {"candidates": [dict(r) for r in rows[i]], "ort_floor": "pending"} for i in rows}
    measured = []
    lazy = FloorSearch(lazy_rows, recipes, lambda i: options({i: lazy_rows[i]["candidates"]})[i],
                       lambda i: measured.append(i) or floors[i])
    budget = rng.uniform(0.002, 0.05)
    want, got = solve(options(eager), budget), lazy.solve(budget)
    assert {i: o.name for i, o in got.items()} == {i: o.name for i, o in want.items()}
    assert sum(o.cost for o in got.values()) == pytest.approx(sum(o.cost for o in want.values()))
    static = {i for i, o in got.items() if o.name.startswith("w8a8@")}
    assert static <= set(measured) and len(measured) == len(set(measured))  # each floor at most once


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"seed{s}")
def test_deferred_candidates_scored_where_picked_give_the_eager_optimum(seed):
    """Candidates entering the search unscored at zero damage, scored only on the layers a solution picks them, with
    onnxruntime's floor measured lazily beside them: the same plan and cost as everything scored and measured first."""
    from ffnquant.planning.floor import FloorSearch, ort_exclude

    rng = random.Random(seed)
    names = ["fp32", "w8a8@search", "w4a16-g128", "w4a16-g128-gptq", "w4a16-g128-awq"]
    recipes = [Recipe.parse(n) for n in names]
    costs = {"fp32": 10.0, "w8a8@search": 5.0, "w4a16-g128": 6.0, "w4a16-g128-gptq": 6.0, "w4a16-g128-awq": 6.2}
    true = {i: {n: {"recipe": n, "layer_sqnr_db": 0.0 if n == "fp32" else rng.uniform(12, 35)} for n in names}
            for i in range(8)}
    floors = {i: {"method": "minmax", "sqnr_db": rng.uniform(12, 30)} for i in true}
    later = {"w4a16-g128-gptq", "w4a16-g128-awq"}

    def damage(r):
        return 0.0 if r["recipe"] == "fp32" or r.get("deferred") else 10 ** (-r["layer_sqnr_db"] / 10)

    eager = {i: [dict(r) for r in true[i].values()] for i in true}
    for i in eager:
        ort_exclude(floors[i], recipes, eager[i])
    want_options = {i: [Option(r["recipe"], damage(r), costs[r["recipe"]]) for r in eager[i] if "excluded" not in r]
                    for i in eager}
    rows = {i: {"candidates": [{"recipe": n, "deferred": True} if n in later else dict(true[i][n]) for n in names],
                "ort_floor": "pending"} for i in true}
    scored, measured = [], []

    def options_of(i):
        return [Option(r["recipe"], damage(r), costs[r["recipe"]]) for r in rows[i]["candidates"] if "excluded" not in r]

    def score(i):
        scored.append(i)
        rows[i]["candidates"] = [dict(true[i][r["recipe"]]) if r.get("deferred") else r for r in rows[i]["candidates"]]

    lazy = FloorSearch(rows, recipes, options_of, lambda i: measured.append(i) or floors[i], score)
    budget = rng.uniform(0.002, 0.05)
    want, got = solve(want_options, budget), lazy.solve(budget)
    assert sum(o.cost for o in got.values()) == pytest.approx(sum(o.cost for o in want.values()))
    assert {i: o.name for i, o in got.items()} == {i: o.name for i, o in want.items()}
    assert {i for i, o in got.items() if o.name in later} <= set(scored) and len(scored) == len(set(scored))


@pytest.mark.parametrize("picked_db, measured", [(34.0, False), (24.0, True)],
                         ids=["clears-plain-int8-not-measured", "near-plain-int8-measured"])
def test_the_floor_is_measured_only_where_the_picked_int8_is_near_the_plain_int8(picked_db, measured):
    """onnxruntime's quantizers compute the plain static int8 grid (no transform), within a few dB of ffnquant's own
    plain int8 calibration; a picked candidate `FLOOR_CLEARANCE_DB` above that cannot fall below their best, so its
    floor is not measured and the layer says why. One nearer is measured as before."""
    from ffnquant.planning.floor import FLOOR_CLEARANCE_DB, FloorSearch

    names = ["fp32", "w8a8@search", "w8a8@search+smooth+float=hidden"]
    recipes = [Recipe.parse(n) for n in names]
    sqnr = {"fp32": 200.0, "w8a8@search": 20.0, "w8a8@search+smooth+float=hidden": picked_db}
    rows = {0: {"candidates": [{"recipe": n, "layer_sqnr_db": sqnr[n]} for n in names], "ort_floor": "pending"}}
    costs = {"fp32": 10.0, "w8a8@search": 3.0, "w8a8@search+smooth+float=hidden": 5.0}

    def options_of(i):  # the plain int8 damages too much for the budget: the float-hidden one is picked
        return [Option(r["recipe"], {"fp32": 0.0, "w8a8@search": 1.0}.get(r["recipe"], 0.001), costs[r["recipe"]])
                for r in rows[i]["candidates"] if "excluded" not in r]

    floors = []
    search = FloorSearch(rows, recipes, options_of, lambda i: floors.append(i) or {"method": "dynamic", "sqnr_db": 21.0})
    got = search.solve(0.01)
    assert got[0].name == "w8a8@search+smooth+float=hidden"
    assert (floors == [0]) is measured
    assert picked_db - 20.0 >= FLOOR_CLEARANCE_DB or measured
    if measured:
        assert rows[0]["ort_floor"] == "measured" and "ort_cleared" not in rows[0]
    else:
        assert rows[0]["ort_floor"] == "pending" and "clears the layer's plain static int8 (w8a8@search, 20.0 dB) by " \
            "14.0 dB" in rows[0]["ort_cleared"]


def _deferred_layers(rng, n_layers, ratio_of):
    """Rows of `n_layers` layers: fp32, static int8, the 4-bit probe (round to nearest) scored, GPTQ and AWQ deferred,
    their true damage `ratio_of(name, i)` x the probe's on the layer; costs of a latency table where 4-bit undercuts
    the float FFN but not int8."""
    names = ["fp32", "w8a8@search", "w4a16-g128", "w4a16-g128-gptq", "w4a16-g128-awq"]
    costs = {"fp32": 10.0, "w8a8@search": 4.0, "w4a16-g128": 6.0, "w4a16-g128-gptq": 6.0, "w4a16-g128-awq": 6.2}
    true = {}
    for i in range(n_layers):
        rtn = rng.uniform(0.01, 0.05) * (10 if rng.random() < 0.15 else 1)  # a layer where rounding fails now and then
        true[i] = {"fp32": 0.0, "w8a8@search": rng.uniform(0.0005, 0.006), "w4a16-g128": rtn,
                   "w4a16-g128-gptq": ratio_of("w4a16-g128-gptq", i) * rtn,
                   "w4a16-g128-awq": ratio_of("w4a16-g128-awq", i) * rtn}
    later = {"w4a16-g128-gptq", "w4a16-g128-awq"}
    rows = {i: {"candidates": [{"recipe": n, "deferred": True} if n in later else {"recipe": n, "damage": true[i][n]}
                               for n in names], "ort_floor": None} for i in true}
    return names, costs, true, later, rows


def _lazy_search(names, costs, true, rows, learn=True):
    from ffnquant.planning.floor import FloorSearch

    def damage(r):
        return r.get("damage_bound", 0.0) if r.get("deferred") else r["damage"]

    def options_of(i):  # as the plan's: a row left out is no option
        return [Option(r["recipe"], damage(r), costs[r["recipe"]]) for r in rows[i]["candidates"] if "excluded" not in r]

    scored = []

    def score(i):
        scored.append(i)
        rows[i]["candidates"] = [{"recipe": r["recipe"], "damage": true[i][r["recipe"]]} if "excluded" not in r else r
                                 for r in rows[i]["candidates"]]

    recipes = [Recipe.parse(n) for n in names]
    return FloorSearch(rows, recipes, options_of, lambda i: None, score, damage=damage if learn else None), scored


@pytest.mark.parametrize("seed", range(8), ids=lambda s: f"seed{s}")
def test_deferred_candidates_with_learned_bounds_give_the_eager_optimum(seed):
    """A deferred candidate's damage bound, learned from the layers it was scored on (`floor.BOUND_MARGIN` x the least
    ratio to round to nearest's damage seen), holds wherever the ratios on other layers are within a factor of two of
    each other: the lazy search then gives the plan and cost of everything scored first."""
    rng = random.Random(seed)
    base = {"w4a16-g128-gptq": rng.uniform(0.2, 0.8), "w4a16-g128-awq": rng.uniform(0.1, 0.6)}
    ratios = {(name, i): base[name] * rng.uniform(1.0, 1.99) for name in base for i in range(12)}
    names, costs, true, later, rows = _deferred_layers(rng, 12, lambda name, i: ratios[name, i])
    budget = rng.uniform(0.005, 0.06)
    want = solve({i: [Option(n, true[i][n], costs[n]) for n in names] for i in true}, budget)
    lazy, scored = _lazy_search(names, costs, true, rows)
    got = lazy.solve(budget)
    assert sum(o.cost for o in got.values()) == pytest.approx(sum(o.cost for o in want.values()))
    assert {i for i, o in got.items() if o.name in later} <= set(scored) and len(scored) == len(set(scored))


def test_deferred_candidates_too_damaging_everywhere_are_scored_on_a_sample_of_layers():
    """Gemma 3 270M's case: 4-bit undercuts the float FFN on the latency table but damages every layer far more than
    int8. At a bound of zero a solution picks it on every layer and every layer is scored; with the learned bound it
    is scored on the sampled layers only, for the same plan."""
    from ffnquant.planning.floor import BOUND_MARGIN, SAMPLE_LAYERS

    rng = random.Random(0)
    names, costs, true, later, rows = _deferred_layers(rng, 18, lambda name, i: 0.5)
    budget = 0.01
    want = solve({i: [Option(n, true[i][n], costs[n]) for n in names] for i in true}, budget)
    eager_rows = {i: {"candidates": [dict(r) for r in e["candidates"]], "ort_floor": None} for i, e in rows.items()}
    zero, scored_at_zero = _lazy_search(names, costs, true, eager_rows, learn=False)
    assert sum(o.cost for o in zero.solve(budget).values()) == pytest.approx(sum(o.cost for o in want.values()))
    lazy, scored = _lazy_search(names, costs, true, rows)
    got = lazy.solve(budget)
    assert {i: o.name for i, o in got.items()} == {i: o.name for i, o in want.items()}
    assert not any(o.name in later for o in got.values())
    assert len(scored) == SAMPLE_LAYERS < len(scored_at_zero)
    assert lazy.bounds["w4a16-g128-gptq"] == {"least_ratio": pytest.approx(0.5), "share": pytest.approx(BOUND_MARGIN * 0.5),
                                              "layers": SAMPLE_LAYERS}
    bound_rows = [r for e in rows.values() for r in e["candidates"] if r.get("deferred")]
    assert bound_rows and all(r["damage_bound"] > 0 for r in bound_rows)


def test_deferred_candidates_without_a_scored_round_to_nearest_row_are_scored_where_picked():
    """A run whose latency table says the 4-bit probe can never be chosen quantizes it for its ablation only: its row
    is unscored (`"scored": False`, no damage). It is no counterpart to learn a bound from (reading its damage raised
    a KeyError in a plan of Gemma 3 270M): the deferred candidates are scored where a solution picks them."""
    rng = random.Random(3)
    names, costs, true, later, rows = _deferred_layers(rng, 6, lambda name, i: 0.5)
    for entry in rows.values():
        for r in entry["candidates"]:
            if r["recipe"] == "w4a16-g128":
                r.pop("damage")
                r.update(scored=False, excluded="the latency table says it can never be chosen")
    names = [n for n in names if n != "w4a16-g128"]
    for entry in rows.values():
        entry["candidates"] = [r for r in entry["candidates"] if r["recipe"] != "w4a16-g128"] + \
            [r for r in entry["candidates"] if r["recipe"] == "w4a16-g128"]
    lazy, scored = _lazy_search(names, costs, true, rows)
    got = lazy.solve(0.01)
    want = solve({i: [Option(n, true[i][n], costs[n]) for n in names] for i in true}, 0.01)
    assert sum(o.cost for o in got.values()) == pytest.approx(sum(o.cost for o in want.values()))
    assert lazy.bounds == {} and scored  # nothing learned; scored where picked


@pytest.mark.parametrize("least_gain, scores", [(0.10, False), (0.02, True)], ids=["saving-within-resolution",
                                                                                    "saving-resolved"])
def test_deferred_candidates_are_scored_only_when_they_could_save_more_than_the_cost_table_resolves(least_gain, scores):
    """Four layers where the search wants fp32 (cost 10); a deferred candidate at cost 9.5 could save at most 5% of
    the plan even at no damage: not worth scoring at a table resolution of 10%, scored at 2%."""
    from ffnquant.planning.floor import FloorSearch

    recipes = [Recipe.parse(r) for r in ("fp32", "w4a16-g128-gptq")]
    true_damage = {"fp32": 0.0, "w4a16-g128-gptq": 1.0}  # far over the budget once scored
    rows = {i: {"candidates": [{"recipe": "fp32"}, {"recipe": "w4a16-g128-gptq", "deferred": True}],
                "ort_floor": None} for i in range(4)}
    scored = []

    def options_of(i):
        return [Option(r["recipe"], 0.0 if r.get("deferred") else true_damage[r["recipe"]],
                       10.0 if r["recipe"] == "fp32" else 9.5) for r in rows[i]["candidates"]]

    def score(i):
        scored.append(i)
        rows[i]["candidates"] = [{"recipe": r["recipe"]} for r in rows[i]["candidates"]]

    search = FloorSearch(rows, recipes, options_of, lambda i: None, score, least_gain=least_gain)
    got = search.solve(0.01)
    assert {o.name for o in got.values()} == {"fp32"}  # the same plan either way: scored, the candidate is too bad
    assert bool(scored) is scores
    assert (search.deferred_skipped is None) is scores
    if not scores:
        assert "5.0%" in search.deferred_skipped and "10.0%" in search.deferred_skipped


def test_a_layers_tasks_sharing_its_float_figures_score_as_each_task_alone():
    """`candidates.score_tasks` computes a layer's float outputs and range profile once for all its remedy sets; the
    scores, and the smoothed candidates among them (which read the plain profile), are those of tasks computing
    their own, bit for bit."""
    from types import SimpleNamespace

    from ffnquant.measure.executor import LocalExecutor
    from ffnquant.model import build
    from ffnquant.planning.candidates import run_score_task, score_layer, score_tasks
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    layer = SimpleNamespace(spec=spec, ffn=build(spec, seed=0), label="L0")
    gen = torch.Generator().manual_seed(0)
    calib, held, grad = (torch.randn(n, 32, generator=gen) for n in (512, 128, 512))
    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@search", "w8a8@search+smooth", "w8a8@search+smooth+rotate")]
    tasks = score_tasks(LocalExecutor(), layer, recipes, calib, held, grad)
    assert len(tasks) == 3 and all(t.floats is not None for t in tasks)
    shared = [s for t in tasks for s in run_score_task(t)[0]]
    alone = score_layer(layer, recipes, calib, held, grad)[0]
    assert [s.to_dict() for s in shared] == [s.to_dict() for s in alone]


def test_fp32_is_scored_without_running_it_as_running_it_scores_it():
    """`score_layer` writes fp32's score down (no output error, 200 dB) instead of quantizing and running the float
    FFN; running it (asked to keep it) gives the same score."""
    from types import SimpleNamespace

    from ffnquant.model import build
    from ffnquant.planning.candidates import score_layer
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    layer = SimpleNamespace(spec=spec, ffn=build(spec, seed=0), label="L0")
    gen = torch.Generator().manual_seed(0)
    calib, held, grad = (torch.randn(n, 32, generator=gen) for n in (512, 128, 256))
    recipes = [Recipe.parse(r) for r in ("w8a8-dynamic-s8", "fp32")]
    written, kept = score_layer(layer, recipes, calib, held, grad)
    run, kept_run = score_layer(layer, recipes, calib, held, grad, keep=[recipes[1]])
    assert [s.recipe for s in written] == ["w8a8-dynamic-s8", "fp32"] and not kept and recipes[1] in kept_run
    assert [s.to_dict() for s in written] == [s.to_dict() for s in run]
    assert written[1].search_rows == 256  # the rows the gradients cover


@pytest.mark.parametrize("shared", [False, True], ids=["alone", "shared-float-figures"])
def test_an_unscored_probe_is_the_ffn_scoring_it_keeps(shared):
    """A probe no solution can choose is only quantized (`score_layer(unscored=...)`): its kept FFN is the one
    scoring it keeps, bit for bit (the quantizers never read the held-out rows), it has no score row, and the
    other candidates' scores are unchanged."""
    from types import SimpleNamespace

    from ffnquant.measure.executor import LocalExecutor
    from ffnquant.model import build
    from ffnquant.planning.candidates import run_score_task, score_layer, score_tasks
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=128)
    layer = SimpleNamespace(spec=spec, ffn=build(spec, seed=0), label="L0")
    gen = torch.Generator().manual_seed(0)
    calib, held, grad = (torch.randn(n, 32, generator=gen) for n in (512, 128, 512))
    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@search", "w8a8@search+smooth", "w8a8-dynamic-s8", "w4a16-g32")]
    probes = recipes[3:]

    def run(unscored):
        if not shared:
            return score_layer(layer, recipes, calib, held, grad, keep=probes, unscored=unscored)
        tasks = score_tasks(LocalExecutor(), layer, recipes, calib, held, grad, keep=probes, unscored=unscored)
        out = [run_score_task(t) for t in tasks]
        return [s for o in out for s in o[0]], {r: q for o in out for r, q in o[1].items()}

    scored, kept_scored = run(())
    only, kept_only = run(probes)
    by_recipe = {s.recipe: s.to_dict() for s in scored}
    assert sorted(s.recipe for s in only) == ["fp32", "w8a8@search", "w8a8@search+smooth"]
    assert all(s.to_dict() == by_recipe[s.recipe] for s in only)
    x = torch.randn(64, 32, generator=gen)
    for p in probes:
        with torch.no_grad():
            assert torch.equal(kept_only[p](x), kept_scored[p](x)), p


def test_choosable_keeps_both_pareto_fronts_and_drops_what_cannot_be_chosen():
    """The FFNs kept for the rounds: the front of (gradient-weighted error x generalization, cost), the front
    without static int8 (onnxruntime's floor may exclude those later), never a failed candidate or one whose input
    scale cannot fold."""
    from ffnquant.planning.job import choosable
    from ffnquant.planning.scores import CandidateScore
    from ffnquant.planning.target import Objective

    def score(recipe, fisher, cost, **kw):
        return CandidateScore(recipe, layer_sqnr_db=30.0, search_sqnr_db=30.0, search_noise=fisher, fisher=fisher,
                              bytes=cost, **kw)

    scores = [score("fp32", 0.0, 100), score("w8a8@search", 1.0, 25), score("w8a8@minmax", 2.0, 25),
              score("w8a8-dynamic-s8", 1.5, 30), score("w4a16-g128", 5.0, 13),
              score("w8a8@search+smooth", 0.5, 25), CandidateScore("w4a16-g128-awq", error="failed")]
    kept = choosable(scores, {}, Objective("bytes"), "kl", None)
    assert kept == {"fp32", "w8a8@search+smooth", "w4a16-g128", "w8a8-dynamic-s8"}
    # smoothing cannot fold on this layer: its candidate is gone, and the next static one takes its place
    assert choosable(scores, {}, Objective("bytes"), "kl", "no norm") == {"fp32", "w8a8@search", "w4a16-g128",
                                                                          "w8a8-dynamic-s8"}


def test_a_round_must_save_more_than_the_latency_table_can_resolve():
    """`steering.min_gain`: 1% for bytes (exact) and for a steady table; twice a noisy table's median relative
    standard error (each recipe's once: a graph timed for another is not counted twice) when that is coarser."""
    from ffnquant.planning.latency_table import request_row
    from ffnquant.planning.steering import MIN_GAIN, min_gain
    from ffnquant.planning.target import Workload

    steady = request_row([10.0] * 21, [1.0] * 21, Workload(16, 0))
    assert steady["median_rel_se"] == 0.0 and min_gain({"fp32": steady}) == MIN_GAIN
    assert min_gain(None) == MIN_GAIN and min_gain({}) == MIN_GAIN
    spread = [float(v) for v in range(5, 26)]  # p10 7, p50 15, p90 23 over 21 samples
    noisy = request_row(spread, [0.0] * 21, Workload(16, 0))
    want = math.sqrt(math.pi / 2) * (23 - 7) / 2.5631 / math.sqrt(21) / 15
    assert noisy["median_rel_se"] == pytest.approx(want)  # about 12%
    table = {"fp32": noisy, "w8a8@minmax": steady, "w8a8@search": dict(steady, timed_as="w8a8@minmax"),
             "w4a16-g128": noisy}
    assert min_gain(table) == pytest.approx(2 * want)


def test_a_layer_scored_on_a_device_copy_scores_as_in_place(monkeypatch):
    """Under `--device cuda` a dense layer's tasks take a copy of its FFN and inputs on the device (`_OnDevice`:
    made by the first task, with the float figures, dropped after the last) and bring what they keep back to host
    memory. Run with the CPU standing in for the device, the scores and the kept FFNs are those of scoring in
    place, bit for bit, and nothing is left on the holder."""
    from types import SimpleNamespace

    from ffnquant.measure.executor import LocalExecutor
    from ffnquant.model import build
    from ffnquant.planning import candidates
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    layer = SimpleNamespace(spec=spec, ffn=build(spec, seed=0), label="L0")
    gen = torch.Generator().manual_seed(0)
    calib, held, grad = (torch.randn(n, 32, generator=gen) for n in (512, 128, 512))
    recipes = [Recipe.parse(r) for r in ("fp32", "w8a8@search", "w8a8@search+smooth", "w4a16-g32-gptq",
                                         "w4a16-g32-awq", "w8a8-dynamic-s8+rotate")]
    keep = recipes[1:]
    alone, kept_alone = candidates.score_layer(layer, recipes, calib, held, grad, keep=keep)
    monkeypatch.setattr(candidates, "_moves", lambda device: True)
    tasks = candidates.score_tasks(LocalExecutor(), layer, recipes, calib, held, grad, keep=keep)
    assert all(t.device is not None and t.floats is None for t in tasks)
    out = [candidates.run_score_task(t) for t in tasks]
    assert tasks[0].device.get().value is None and tasks[0].device.get().left == 0
    assert sorted((s.to_dict() for o in out for s in o[0]), key=str) == sorted((s.to_dict() for s in alone), key=str)
    kept = {r: q for o in out for r, q in o[1].items()}
    x = torch.randn(16, 32, generator=gen)
    for r in keep:
        assert kept[r] is not kept_alone[r]
        with torch.no_grad():
            assert torch.equal(kept[r](x), kept_alone[r](x)), r
    assert layer.ffn.w_up.weight.data_ptr() != kept[recipes[1]].model.w_up.weight.data_ptr()  # the source untouched
