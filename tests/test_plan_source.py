"""planning.source: a plan made with the model read a decoder layer at a time is the plan made with it resident, bit
for bit, and its loss gradients are those of one backward pass through transformers' whole forward.

Both modes hand the same float32 tensors to the same steps: the FFN inputs the model's own decoder layers
produce, the loss gradients of the layer-by-layer backward pass, the probes' ablations and the verification
rounds. So the comparisons are exact equality: the plan file, and plan.json's every figure except the timings.
"""

from __future__ import annotations

import json

import pytest
import torch

from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.recipe import Recipe

from hf_models import tiny_folders

pytestmark = pytest.mark.hf

# a mix of the candidate kinds (static int8 with the onnxruntime floor, a float site, 4-bit weights, dynamic int8)
CANDIDATES = "fp32,w8a8@search,w8a8-dynamic-s8,w4a16-g32,w8a8@search+float=hidden"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {name: folder for name, (folder, _, _) in tiny_folders(tmp_path_factory, ("llama", "gpt2")).items()}


def _settings():
    from ffnquant.hf import EvalSettings

    return EvalSettings(seq_len=16, batch_size=4, max_calib_tokens=192, max_eval_tokens=96, ablation=False)


def _plan(folder, streamed: bool, spill: bool = False, target: str = "ppl+1%", ort_floor: bool = False,
          dtype=None):
    from ffnquant.hf import inspect_model
    from ffnquant.hf.memory import MemoryPlan
    from ffnquant.planning.job import make_plan
    from ffnquant.planning.target import Objective

    memory = MemoryPlan(streamed, spill, None, 0, 0, 0, 0, 0, 0, "test") if streamed else None
    plan, result = make_plan(inspect_model(folder), target, Objective("bytes"), CANDIDATES, settings=_settings(),
                             probe_tokens=64, ort_floor=ort_floor, memory=memory, dtype=dtype)
    assert result.pop("streamed") is streamed
    result.pop("timings")
    return plan.to_toml(), json.dumps(result, default=str)


# gpt2: a tied head (the gradient at the last layer's output through the embedding's matrix), tuple block outputs,
# learned positions; the other architectures stream forward as tests/test_hf_stream.py checks
@pytest.mark.parametrize("name, spill, target, ort_floor", [
    ("llama", False, "ppl+1%", True), ("llama", True, "sqnr>=30", False), ("gpt2", False, "sqnr>=30", False)],
    ids=["llama", "llama-spilled-sqnr-target", "gpt2-tied-head-learned-positions"])
def test_the_streamed_plan_is_the_resident_plan(tiny, tmp_path, monkeypatch, name, spill, target, ort_floor):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the spilled tensors' folder, to see it go
    want = _plan(tiny[name], False, target=target, ort_floor=ort_floor)
    got = _plan(tiny[name], True, spill, target=target, ort_floor=ort_floor)
    assert got[0] == want[0]  # the same plan.toml
    assert got[1] == want[1]  # and every figure of plan.json, in the same order
    data = json.loads(got[1])
    assert any(name != "fp32" for r in data["rounds"] for name in r["layers"].values())  # something was verified
    assert list(tmp_path.iterdir()) == []  # the spilled tensors are gone


def test_deferred_candidates_that_could_not_pay_are_never_scored(tiny, monkeypatch):
    """With a cost table resolving no saving under 99% (patched), GPTQ and AWQ could never save enough to be worth
    scoring: none is scored, the plan is the one made without them, and plan.md says why."""
    import ffnquant.planning.job as job
    from ffnquant.hf import inspect_model
    from ffnquant.planning.target import Objective
    from ffnquant.report.plan import plan_markdown

    monkeypatch.setattr(job, "min_gain", lambda latency: 0.99)

    def plan(candidates):
        p, result = job.make_plan(inspect_model(tiny["llama"]), "ppl+1%", Objective("bytes"), candidates,
                                  settings=_settings(), probe_tokens=64)
        return p.to_toml(), result

    with_them, result = plan("fp32,w8a8-dynamic-s8,w4a16-g32-gptq,w4a16-g32-awq")
    without, _ = plan("fp32,w8a8-dynamic-s8")
    assert result["deferred_skipped"] and result["deferred"] == {"w4a16-g32-gptq": [], "w4a16-g32-awq": []}
    assert with_them == without
    text = plan_markdown(result)
    assert "(w4a16-g32-gptq, w4a16-g32-awq) were not scored: even at no damage they could save" in text
    assert "the plan is the one scoring them everywhere gives" not in text


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_deferred_candidates_give_the_plan_scoring_them_everywhere_gives(tiny, monkeypatch, streamed):
    """GPTQ and AWQ are scored only on the layers where a solution picks one (`candidates.deferred`); the plan, every
    round and every scored figure are those of a plan that scores them on every layer first."""
    import ffnquant.planning.job as job
    from ffnquant.hf import inspect_model
    from ffnquant.hf.memory import MemoryPlan
    from ffnquant.planning.target import Objective

    candidates = "fp32,w8a8-dynamic-s8,w4a16-g32-gptq,w4a16-g32-awq"

    def plan():
        memory = MemoryPlan(True, False, None, 0, 0, 0, 0, 0, 0, "test") if streamed else None
        p, result = job.make_plan(inspect_model(tiny["llama"]), "ppl+1%", Objective("bytes"), candidates,
                                  settings=_settings(), probe_tokens=64, memory=memory)
        return p.to_toml(), result

    lazy_toml, lazy = plan()
    monkeypatch.setattr(job, "deferred", lambda recipe: False)
    eager_toml, eager = plan()
    assert lazy_toml == eager_toml
    assert set(lazy["deferred"]) == {"w4a16-g32-gptq", "w4a16-g32-awq"} and eager["deferred"] == {}
    keys = ("round", "budget", "predicted", "measured", "met", "cost", "layers")
    assert [{k: r[k] for k in keys} for r in lazy["rounds"]] == [{k: r[k] for k in keys} for r in eager["rounds"]]
    from ffnquant.report.plan import plan_markdown

    assert "Candidates scored only on the layers where a solution picked one" in plan_markdown(lazy)
    for i, layer in lazy["layers"].items():
        mine = {r["recipe"]: r for r in eager["layers"][i]["candidates"]}
        for row in layer["candidates"]:
            if row.get("scored") is not False:  # what was scored is what scoring everywhere gives, bit for bit
                assert row == mine[row["recipe"]]
            else:
                assert row.get("deferred") and int(i) not in lazy["deferred"][row["recipe"]]


def test_a_floor_first_picked_in_a_later_round_is_measured_there(tiny, monkeypatch):
    """Round 1 aimed at almost no damage keeps every layer float; round 2 then picks static int8, so onnxruntime's
    floor is measured and the search solved again inside the rounds' loop (where a name the loop rebinds once broke
    that re-solve). Also: a float round steps on toward the budget (it once capped the next at 1.5 x 0), and a
    budget of 0 allows no damage (`test_plan.py::test_a_zero_budget_allows_no_damage`)."""
    import ffnquant.planning.job as job
    from ffnquant.hf import inspect_model
    from ffnquant.planning.target import Objective

    import ffnquant.planning.floor as floor

    monkeypatch.setattr(job, "first_noise", lambda target, w, tokens: {label: 1e6 for label in tokens})
    # the floor of onnxruntime's static MinMax alone: its per-tensor weights stay below w8a8@search, while its
    # dynamic quantizer beats static int8 on some random tiny models (then no round could pick it: the subject here
    # is the re-solve, not the floor's value). The methods travel with each floor's arguments, helper included.
    monkeypatch.setattr(floor, "FLOOR_METHODS", ("minmax",))
    _, result = job.make_plan(inspect_model(tiny["llama"]), "sqnr>=30", Objective("bytes"),
                              "fp32,w8a8@search", settings=_settings(), probe_tokens=64, ort_floor=True)
    first, later = result["rounds"][0], result["rounds"][1:]
    assert set(first["layers"].values()) == {"fp32"} and later
    assert any(layer["ort_floor"] == "measured" for layer in result["layers"].values())
    assert all(set(layer["ort_best"]["methods"]) == {"minmax"} for layer in result["layers"].values()
               if layer["ort_floor"] == "measured")
    assert any(name == "w8a8@search" for r in later for name in r["layers"].values())


def test_a_plan_verified_in_bf16_is_the_same_streamed_or_resident(tiny, tmp_path, monkeypatch):
    """The verification rounds in bf16 (a second engine computing in it) give the same plan and figures whether the
    model is resident or read a layer at a time and spilled; the figures are the bf16 computation's, not the
    float32 ones."""
    import tempfile

    pytest.importorskip("compressed_tensors")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    want = _plan(tiny["llama"], False, target="sqnr>=30", dtype=torch.bfloat16)
    got = _plan(tiny["llama"], True, True, target="sqnr>=30", dtype=torch.bfloat16)
    assert got == want
    data, float32 = json.loads(got[1]), json.loads(_plan(tiny["llama"], False, target="sqnr>=30")[1])
    assert data["verified_in"] == "bfloat16" and float32["verified_in"] == "float32"
    assert data["rounds"][0]["end_to_end"] != float32["rounds"][0]["end_to_end"]
    # the baseline the figures are against is the float model's in bf16: each domain's perplexity minus its change
    for label, fig in data["rounds"][-1]["domains"].items():
        base = data["baseline"]["domains"][label]["perplexity"]
        assert base == pytest.approx(fig["perplexity"] - fig["perplexity_delta"], rel=1e-12)
        assert base != float32["baseline"]["domains"][label]["perplexity"]
    assert list(tmp_path.iterdir()) == []


def test_a_resident_plans_rounds_reuse_the_scored_ffns(tiny, monkeypatch):
    """Resident, the candidates a plan could choose stay from the scoring (`planning.job.choosable`), so no round
    quantizes a layer again; the plan is the streamed one's all the same (the test above), which quantizes each
    round's layers afresh."""
    from ffnquant.planning import candidates

    calls = []
    real = candidates.quantize_layer
    monkeypatch.setattr(candidates, "quantize_layer", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    data = json.loads(_plan(tiny["llama"], False, ort_floor=True)[1])
    assert any(name != "fp32" for r in data["rounds"] for name in r["layers"].values())
    assert calls == []
    _plan(tiny["llama"], True, ort_floor=True)  # streamed: every round quantizes its layers
    assert calls


@pytest.mark.parametrize("streamed", [False, True], ids=["resident", "streamed"])
def test_a_plan_scoring_on_device_copies_is_the_plan_scoring_in_place(tiny, monkeypatch, streamed):
    """Under `--device cuda` each dense layer's candidates are scored on a copy of the layer and its inputs on the
    device, and the FFNs quantized for the rounds are made there too (`candidates._OnDevice`); with the CPU standing
    in for the device, the plan and every figure are those of scoring in place."""
    from ffnquant.planning import candidates

    in_place = _plan(tiny["llama"], streamed, ort_floor=True)
    moved = []
    monkeypatch.setattr(candidates, "_moves", lambda device: moved.append(device) or True)
    assert _plan(tiny["llama"], streamed, ort_floor=True) == in_place
    assert moved


def _whole_model_gradients(model, batches):
    """The reference: d(summed next-token NLL)/d(each FFN's output) from one backward pass of the whole model per
    batch, the outputs marked by the plan's own gradient probe."""
    from ffnquant.planning.sensitivity import _nll_sum, gradient_probe

    mlps = {j: block.mlp for j, block in enumerate(model.model.layers)}
    grads = {j: [] for j in mlps}
    for ids in batches:
        found = {}
        handles = [m.register_forward_hook(gradient_probe(found, j)) for j, m in mlps.items()]
        try:
            with torch.enable_grad():
                loss = _nll_sum(model(input_ids=ids).logits, ids)
                got = torch.autograd.grad(loss, [found[j] for j in sorted(found)])
        finally:
            for h in handles:
                h.remove()
        for j, g in zip(sorted(found), got):
            grads[j].append(g.detach().reshape(-1, g.shape[-1]).float())
    return {j: torch.cat(v) for j, v in grads.items()}


@pytest.mark.parametrize("resident, score_rows", [(True, None), (False, None), (True, 64), (False, 64)],
                         ids=["resident", "streamed", "resident-leading-batch", "streamed-leading-batch"])
def test_the_layer_by_layer_gradients_are_the_whole_model_ones(tiny, monkeypatch, resident, score_rows):
    """Pass 2 (each decoder layer recomputed on its kept input, the gradient carried back) against one backward
    pass of the whole model: the same FFN output gradients, exactly, in float32 products (bf16 ones are held to
    their rounding below). With fewer scored rows than search tokens, the gradients are taken on the leading whole
    batches holding them alone, and are those of the whole model's backward pass of those batches' loss."""
    from ffnquant.infra import blas
    from ffnquant.hf import inspect_model

    monkeypatch.setitem(blas._BF16, "cpu", False)
    from ffnquant.hf.capture import load_hf_model
    from ffnquant.hf.stream import token_batches_of
    from ffnquant.planning.source import PlanSource

    info, settings = inspect_model(tiny["llama"]), _settings()
    model = load_hf_model(info)
    for p in model.parameters():
        p.requires_grad_(False)
    batches = token_batches_of(info, None, "calibration", settings, settings.max_calib_tokens)
    if score_rows is not None:  # 64 rows: the first batch of 4 x 16 tokens, of the three
        monkeypatch.setattr("ffnquant.planning.source.SCORE_ROWS", score_rows)
        assert len(batches) == 3 and batches[0].numel() == score_rows
        batches = batches[:1]
    want = _whole_model_gradients(model, batches)
    with PlanSource(info, settings, None, None, 64, resident, False, None, {}) as source:
        assert source.n_grad_batches == len(batches)
        for j in range(info.n_layers):
            assert torch.equal(source.grads.get(j), want[j]), j
        assert not any(p.requires_grad for p in source.model.model.parameters())


def test_the_training_backwards_gradients_are_the_evaluation_ones(tiny, monkeypatch):
    """A model whose forward computes without autograd (Reformer's reversible layers) gives its FFN output gradients
    from its own training backward: the decoder layers alone in training mode, each gradient read where the FFN's
    output receives it. On a model both passes run, the two are the same gradients."""
    from ffnquant.infra import blas
    from ffnquant.hf import inspect_model
    from ffnquant.hf.stream import token_batches_of
    from ffnquant.planning.source import PlanSource

    monkeypatch.setitem(blas._BF16, "cpu", False)
    info, settings = inspect_model(tiny["llama"]), _settings()
    ids = token_batches_of(info, None, "calibration", settings, settings.max_calib_tokens)[0]
    with PlanSource(info, settings, None, None, 64, True, False, None, {}) as source:
        evaluation = source._whole_gradients(ids, modes=(False,))
        training = source._whole_gradients(ids, modes=(True,))
        assert not any(layer.training for layer in source.model.layers)
    assert sorted(evaluation) == sorted(training) == list(range(info.n_layers))
    for j, want in evaluation.items():
        assert torch.allclose(training[j], want, rtol=1e-6, atol=1e-9 * float(want.abs().max())), j


def test_the_gradients_in_bf16_products_are_the_float32_ones_within_bf16_rounding(tiny, monkeypatch):
    """Where the CPU multiplies bf16 natively, pass 2 and the head's backward product multiply in bf16 (the
    gradients only weigh the candidates' errors): each FFN's output gradient within a few bf16 roundings (2^-8
    relative each, a handful of products deep in this 2-layer model) of the float32 one, in L2 norm."""
    from ffnquant.infra import blas
    from ffnquant.hf import inspect_model
    from ffnquant.planning.source import PlanSource

    info, settings = inspect_model(tiny["llama"]), _settings()
    grads = {}
    for native in (False, True):
        monkeypatch.setitem(blas._BF16, "cpu", native)
        with PlanSource(info, settings, None, None, 64, True, False, None, {}) as source:
            grads[native] = {j: source.grads.get(j) for j in range(info.n_layers)}
    for j, want in grads[False].items():
        rel = float((grads[True][j] - want).norm() / want.norm())
        assert rel <= 8 * 2.0 ** -8, (j, rel)


def test_the_plan_memory_estimate_chooses_whole_streamed_or_spilled(tiny, monkeypatch):
    from ffnquant.hf import inspect_model
    from ffnquant.hf.memory import plan_memory
    from ffnquant.planning.source import plan_needs

    info = inspect_model(tiny["llama"])
    monkeypatch.setattr("ffnquant.hf.memory.process_rss", lambda: 100 * 10**6)  # a fixed runtime: exact estimates

    def plan(calib_tokens=20_000, **kw):
        needs = plan_needs(info, calib_tokens=calib_tokens, eval_tokens=20_000, probe_tokens=512, batch_tokens=512)
        return plan_memory(info, needs, **kw)

    p = plan(max_memory=10**12)
    assert (p.sequential, p.spill, p.reason) == (False, False, "it fits")
    assert p.spilled < p.streamed < p.in_memory
    assert plan(max_memory=10**12, sequential=True).sequential
    spilled = plan(max_memory=p.streamed - 1)
    assert (spilled.sequential, spilled.spill) == (True, True) and "spilled to" in spilled.reason
    assert spilled.peak == p.spilled
    # what is kept per layer grows with the search tokens: FFN inputs, gradients, decoder-layer inputs
    assert plan(21_000, max_memory=10**12).calibration - p.calibration == \
        (3 * info.n_layers + 4) * 1000 * info.spec.d_model * 4
    with pytest.raises(FFNQuantError, match="even with its hidden states .* on disk") as err:
        plan(max_memory=p.spilled - 1)
    assert "\n" not in str(err.value) and "--probe-tokens" in str(err.value)


def test_plan_sequential_on_the_command_line(tiny, tmp_path, capsys):
    out = tmp_path / "plan"
    argv = ["plan", "--model", str(tiny["llama"]), "--target", "ppl+1%", "--objective", "bytes", "--candidates",
            "fp32,w8a8-dynamic-s8,w4a16-g32", "--calib-tokens", "192", "--eval-tokens", "96", "--probe-tokens", "64",
            "--no-progress", "--out", str(out)]
    assert main(argv + ["--sequential"]) == 0
    printed = capsys.readouterr().out
    assert "memory: layer by layer (--sequential); estimated peak" in printed
    data = json.loads((out / "plan.json").read_text())
    assert data["streamed"] and data["memory"]["sequential"] and data["verified"]
    assert "- model run: a decoder layer at a time (--sequential; estimated peak" in (out / "plan.md").read_text()
    from ffnquant.planning import load_plan

    assert set(load_plan(out / "plan.toml").layers) == {0, 1}
    # --sequential and --no-sequential exclude each other
    assert main(argv + ["--sequential", "--no-sequential"]) == 2


@pytest.mark.parametrize("first, second", [
    ({0: "w8a8-dynamic-s8", 1: "fp32"}, {0: "w8a8-dynamic-s8", 1: "w4a16-g32"}),
    ({0: "fp32", 1: "w4a16-g32"}, {0: "w8a8-dynamic-s8", 1: "w4a16-g32"}),
    ({0: "w4a16-g32", 1: "fp32"}, {0: "w4a16-g32", 1: "fp32"})],
    ids=["second-layer-changed", "first-layer-changed", "unchanged"])
def test_a_round_starting_at_its_first_changed_layer_gives_the_figures_of_a_whole_round(tiny, first, second):
    """A resident source keeps each round's held-out stream after every layer; the next round starts at the first
    layer whose choice changed. Its figures are those of a source that runs that round alone, bit for bit."""
    from ffnquant.hf import inspect_model
    from ffnquant.planning.source import PlanSource

    info, settings = inspect_model(tiny["llama"]), _settings()
    by_name = {n: Recipe.parse(n) for n in ("w8a8-dynamic-s8", "w4a16-g32")}
    progress = []
    with PlanSource(info, settings, None, None, 64, True, False, lambda *a: progress.append(a[0]), {}) as source:
        source.verify(first, by_name)
        progress.clear()
        got = source.verify(second, by_name)
    reused = [line for line in progress if "(as the last round)" in line]
    changed = [j for j in first if first[j] != second[j]]
    assert len(reused) == (min(changed) if changed else info.n_layers - 1)
    with PlanSource(info, settings, None, None, 64, True, False, None, {}) as fresh:
        want = fresh.verify(second, by_name)
    assert json.dumps(got, default=str) == json.dumps(want, default=str)



def test_a_block_that_returns_a_list_gives_its_gradients(tmp_path):
    """OpenAI GPT's blocks return a list: the layer-by-layer backward takes its hidden states from it, as the engine
    does (it read the list itself as the output, an internal error at the gradients' check)."""
    from ffnquant.hf import inspect_model
    from ffnquant.planning.source import PlanSource
    from hf_models import tiny_or_skip

    info = inspect_model(tiny_or_skip("openai-gpt", tmp_path / "openai-gpt"))
    with PlanSource(info, _settings(), None, None, 64, True, False, None, {}) as source:
        assert not source.model.replay
        for j in range(info.n_layers):
            assert source.grads.get(j).abs().sum() > 0, j
