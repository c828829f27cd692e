"""An FFN whose module also reads its input beside its Linears (Zamba 2's shared MLP adds each calling layer's own
low-rank adapter of its input to gate and up): found by running the module on the FFN's input with its Linears
answering the products (`hf.own.OwnMiddle.reads_input`), each call computing with its own adapters, quantized
from every call's statistics merged (range histograms, GPTQ's Hessians), every call to the same weights and ranges,
and its folder proven."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.hf import inspect_model, load_ffn_layers
from ffnquant.hf.arch import Install
from ffnquant.hf.ffn_candidates import FoundFFN
from ffnquant.hf.inputs import LayerInputs
from ffnquant.hf.layers import quantize_layers, quantized_layers
from ffnquant.hf.own import OwnMiddle, own_middle, rowwise
from ffnquant.planning.planfile import Plan, model_fingerprint
from ffnquant.planning.rows import calibration_exclude
from ffnquant.recipe import Recipe
from ffnquant.spec import Activation

T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")

TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128"]


@pytest.fixture(scope="module")
def zamba2(tmp_path_factory):
    from hf_models import tiny_or_skip

    return tiny_or_skip("zamba2", tmp_path_factory.mktemp("adapters") / "zamba2")


class _AdaptedMLP(nn.Module):
    """A gated MLP adding a per-call low-rank adapter of its input to gate and up (Zamba 2's form, in small)."""

    def __init__(self, d: int = 6, f: int = 10, calls: int = 2) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.adapters = nn.ModuleList(nn.Sequential(nn.Linear(d, 3, bias=False), nn.Linear(3, 2 * f, bias=False))
                                      for _ in range(calls))

    def forward(self, x: torch.Tensor, layer_idx: int) -> torch.Tensor:
        gate, up = (self.gate_up_proj(x) + self.adapters[layer_idx](x)).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


def _found(d: int = 6, f: int = 10) -> FoundFFN:
    return FoundFFN(path="", install=Install.MODULE, roles={"gate_up_proj": "w_gate+w_up", "down_proj": "w_down"},
                    d_model=d, d_ff=f, gated=True)


@pytest.mark.parametrize("layer_idx", [0, 1], ids=["call0", "call1"])
def test_a_middle_reading_the_input_computes_the_module_with_its_linears_answering(layer_idx):
    torch.manual_seed(0)
    mlp = _AdaptedMLP()
    middle = own_middle(mlp, _found(), {"gate_up_proj": "w_gate+w_up", "down_proj": "w_down"}, reads_input=True,
                        layer_idx=layer_idx)
    assert isinstance(middle, OwnMiddle) and middle.reads_input
    x = torch.randn(4, 6)
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    with torch.no_grad():
        hidden = middle(gate, up, x=x)
        want = mlp(x, layer_idx)
    assert torch.allclose(mlp.down_proj(hidden), want, rtol=0, atol=1e-6)
    assert middle.given.parts == ()  # what the stand-ins answered is let go after the call
    assert rowwise(lambda *z: middle(*z[:-1], x=z[-1]), 10, torch.Generator().manual_seed(0), 2, widths=(6,))


def test_a_middle_reading_the_input_refuses_a_call_without_it():
    middle = own_middle(_AdaptedMLP(), _found(), {"gate_up_proj": "w_gate+w_up", "down_proj": "w_down"},
                        reads_input=True, layer_idx=0)
    with pytest.raises(TypeError, match="reads the FFN's input"):
        middle(torch.zeros(1, 10), torch.zeros(1, 10))


def test_zamba2s_shared_mlp_is_found_and_each_call_reproduces_the_models_module(zamba2):
    from ffnquant.hf.capture import load_hf_model

    info = inspect_model(zamba2)
    assert info.spec.activation is Activation.OWN_GATE and info.calls_differ()
    assert [layer.shares for layer in info.layers] == [None, 0]
    layers = load_ffn_layers(info)
    model = load_hf_model(info)
    mlps = [model.model.layers[layer.info.block].shared_transformer.feed_forward for layer in layers]
    assert mlps[0].gate_up_proj.weight is mlps[1].gate_up_proj.weight  # tied: one FFN, stored once
    x = torch.randn(9, info.spec.d_model, generator=torch.Generator().manual_seed(1))
    outs = []
    with torch.no_grad():
        for layer, mlp in zip(layers, mlps):
            assert layer.ffn.activation.layer_idx == layer.info.block
            want = mlp(x, layer_idx=layer.info.block)
            got = layer.ffn(x)
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
            outs.append(got)
    assert not torch.allclose(outs[0], outs[1])  # the two calls' adapters differ: two functions


def test_the_calls_share_one_module_and_a_copy_or_a_pickle_computes_the_same(zamba2):
    """A later call's middle is the first call's module with its own index (its block's adapters held once); a
    deep copy (what quantizing copies) and a pickle (what a worker receives) compute what it does."""
    import copy
    import pickle

    layers = load_ffn_layers(inspect_model(zamba2))
    first, later = (layer.ffn.activation for layer in layers)
    assert later.stored is first.stored and (first.layer_idx, later.layer_idx) == (0, 1)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = layers[1].ffn(x)
        for other in (copy.deepcopy(layers[1].ffn), pickle.loads(pickle.dumps(layers[1].ffn))):
            assert torch.equal(other(x), want)
            assert other.activation.given is not later.given


def _inputs(labels):
    g = torch.Generator().manual_seed(0)
    calib = {label: torch.randn(64, 32, generator=g) for label in labels}
    held = {label: torch.randn(16, 32, generator=g) for label in labels}
    return LayerInputs(calib, held, "calib", "held", "different texts", {})


@pytest.mark.parametrize("recipe", ["w4a16-g32", "w8a8-dynamic-s8", "w8a8", "w4a16-g32-gptq"])
def test_each_call_is_quantized_through_its_own_adapters_to_the_same_weights(zamba2, recipe):
    info = inspect_model(zamba2)
    layers = load_ffn_layers(info)
    inputs = _inputs([layer.label for layer in layers])
    rows, qffns = quantized_layers(info, layers, inputs, Recipe.parse(recipe), onnx=False, sensitivity=False)
    assert [r.get("shares") for r in rows] == [None, "L0"] and rows[1]["own_inputs"]
    first, second = (qffns[label] for label in ("L0", "L1"))
    assert first is not second and second.model.activation.layer_idx == 1
    w0, w1 = first.model.weights(), second.model.weights()
    assert all(torch.equal(w0[n], w1[n]) for n in w0) and first.ranges == second.ranges  # what the model stores
    # each call's figures are its own: measured on its own held-out rows through its own adapters
    assert rows[1]["accuracy_torch"] != rows[0]["accuracy_torch"]


@pytest.mark.parametrize("recipe", ["w8a8", "w4a16-g32-gptq"])
def test_a_calibrated_recipe_reads_every_calls_statistics_through_its_own_adapters(zamba2, recipe):
    """Static ranges from the range histograms of both calls, each through its own FFN, merged; GPTQ from their
    Hessians summed: neither call's alone, and not both calls' rows through one call's FFN."""
    from ffnquant.methods.fakequant import input_hessians
    from ffnquant.numerics.observe import profile
    from ffnquant.quantization import quantize_recipes

    info = inspect_model(zamba2)
    layers = load_ffn_layers(info)
    inputs = _inputs([layer.label for layer in layers])
    q = next(quantize_layers(layers, [Recipe.parse(recipe)], inputs)).result.qmodel
    tables = [profile(layer.ffn, [inputs.calib[layer.label]], sites=["input", "hidden"], weights=False)
              for layer in layers]
    hess = [input_hessians(layer.ffn, [inputs.calib[layer.label]]) for layer in layers]
    want = next(quantize_recipes(layers[0].spec, [Recipe.parse(recipe)], model=layers[0].ffn,
                                 calib_tokens=inputs.calib["L0"], eval_tokens=inputs.eval["L0"],
                                 profiles={(): tables[0].merge(tables[1])},
                                 hessians={k: hess[0][k] + hess[1][k] for k in hess[0]})).result.qmodel
    alone = next(quantize_layers(layers[:1], [Recipe.parse(recipe)], inputs)).result.qmodel  # L0 alone, unshared
    assert q.ranges == want.ranges and all(torch.equal(q.model.weights()[n], want.model.weights()[n])
                                           for n in want.model.weights())
    differs = (q.ranges != alone.ranges) if recipe == "w8a8" else any(
        not torch.equal(q.model.weights()[n], alone.model.weights()[n]) for n in alone.model.weights())
    assert differs  # the second call's statistics moved it


@pytest.mark.parametrize("recipe", ["w8a8@search", "w8a8@minmax+smooth", "w4a16-g32-awq"])
def test_a_recipe_computing_from_the_rows_is_refused_for_calls_that_differ(zamba2, recipe):
    info = inspect_model(zamba2)
    layers = load_ffn_layers(info)
    with pytest.raises(FFNQuantError, match=r"computes from the calibration rows themselves .* layers L0, L1 call one "
                                            r"FFN .* valid there: static ranges of a histogram calibrator"):
        next(quantize_layers(layers, [Recipe.parse(recipe)], _inputs(["L0", "L1"])))


def test_the_command_and_a_plan_refuse_such_a_recipe_before_reading_weights(zamba2, tmp_path, capsys):
    assert main(["quantize", "--model", str(zamba2), "--scheme", "w8a8", "--calibrator", "search", *TOKENS,
                 "--no-onnx", "--no-progress", "--out-reports", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert "recipe w8a8@search computes from the calibration rows" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "q").exists()
    info = inspect_model(zamba2)
    smooth = Recipe.parse("w8a8@minmax+smooth")
    with pytest.raises(FFNQuantError, match="computes from the calibration rows"):
        Plan(model_fingerprint(info), {0: smooth, 1: smooth}, "ppl+1%", "latency").check_model(info)
    static = Recipe.parse("w8a8")
    Plan(model_fingerprint(info), {0: static, 1: static}, "ppl+1%", "latency").check_model(info)  # merged: taken


def test_the_plan_excludes_only_candidates_whose_calibration_does_not_merge():
    rows = [{"recipe": "w8a8@search", "error": None}, {"recipe": "w8a8", "error": None},
            {"recipe": "w4a16-g32-gptq", "error": None}, {"recipe": "w8a8@minmax+smooth", "error": None}]
    calibration_exclude(rows, "layers L0, L1 call one FFN each with its own adapters")
    assert [("excluded" in r) for r in rows] == [True, False, False, True]
    assert rows[0]["excluded"].startswith("it computes from the calibration rows themselves: layers L0, L1")
    calibration_exclude(rows[1:2], None)
    assert "excluded" not in rows[1]


def test_the_plan_chooses_static_int8_from_merged_statistics_and_its_folder_is_proven(zamba2, tmp_path, capsys):
    """The verification rounds quantize each call through its own adapters from every call's kept rows' statistics
    merged, as the export does: the verified figures are the deployed model's."""
    plan = tmp_path / "p"
    assert main(["plan", "--model", str(zamba2), "--target", "ppl+5%", "--objective", "bytes",
                 "--candidates", "fp32,w8a8@search,w8a8", *TOKENS, "--seq-len", "128", "--no-ort-floor",
                 "--probe-tokens", "128", "--no-progress", "--out", str(plan)]) == 0
    data = json.loads((plan / "plan.json").read_text())
    chosen = {row["index"]: row["recipe"] for row in data["plan"]["layers"]}
    assert chosen == {0: "w8a8", 1: "w8a8"}
    searched = [c for row in data["layers"].values() for c in row["candidates"] if c["recipe"] == "w8a8@search"]
    assert searched and all("computes from the calibration rows" in c["excluded"] for c in searched)
    verified = data["final_round"]
    capsys.readouterr()
    rc = main(["export", "--model", str(zamba2), "--plan", str(plan / "plan.toml"), "--format", "compressed-tensors",
               *TOKENS, "--seq-len", "128", "--no-progress", "--out", str(tmp_path / "ct")])
    assert rc == 0, capsys.readouterr()
    proof = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())["proof"]
    assert proof["proven"] and proof["weights"]["all_identical"] and proof["layers"]["all_at_parity"]
    assert proof["layers"]["layers"] == 2 and verified


@pytest.fixture(scope="module")
def zamba2_two_blocks(tmp_path_factory):
    """Zamba 2 as its larger checkpoints are built: two shared blocks called in turn by four hybrid layers, each
    block's MLP holding the adapters of its own calls alone."""
    from hf_models import save_causal_tiny, tokenizer

    T.logging.set_verbosity_error()
    return save_causal_tiny(T, "zamba2", tmp_path_factory.mktemp("adapters") / "two", tokenizer(T),
                            layers_block_type=["hybrid"] * 4, num_hidden_layers=4, num_mem_blocks=2,
                            hybrid_layer_ids=[0, 1, 2, 3])


def test_two_shared_blocks_each_read_with_their_own_adapters_and_proven(zamba2_two_blocks, tmp_path, capsys):
    info = inspect_model(zamba2_two_blocks)
    assert [layer.shares for layer in info.layers] == [None, None, 0, 1]
    # block 1's MLP keeps adapters 1 and 3 (the others identities): its own template, read under its own names
    assert set(info.arch.activation_templates) == {1, 3}
    layers = load_ffn_layers(info)
    assert [layer.ffn.activation.layer_idx for layer in layers] == [0, 1, 2, 3]
    plan = tmp_path / "plan.toml"
    # static int8: each block's one set of input ranges, from its two calls' statistics merged
    plan.write_text(Plan(model_fingerprint(info), {i: Recipe.parse("w8a8") for i in range(4)}, "ppl+5%",
                         "bytes").to_toml())
    rc = main(["export", "--model", str(zamba2_two_blocks), "--plan", str(plan), "--format", "compressed-tensors",
               *TOKENS, "--seq-len", "128", "--no-progress", "--out", str(tmp_path / "ct")])
    assert rc == 0, capsys.readouterr()
    proof = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())["proof"]
    assert proof["proven"] and proof["layers"]["layers"] == 4 and proof["layers"]["all_at_parity"]
    assert proof["weights"]["all_identical"]


def test_the_run_reports_the_shared_ffn_as_deployed(zamba2_two_blocks, tmp_path, capsys):
    """`ffnquant run --model`: its end-to-end figures compute each shared FFN with its one quantization (from every
    call's statistics, through each call's own adapters), the figures `quantize --model` reports, not each call's
    own quantization as its per-layer table scores them."""
    assert main(["quantize", "--model", str(zamba2_two_blocks), "--scheme", "w8a8", *TOKENS, "--no-onnx",
                 "--no-progress", "--out-reports", str(tmp_path / "q")]) == 0
    want = json.loads(next((tmp_path / "q").glob("*.json")).read_text())["end_to_end"]["end_to_end"]
    assert main(["run", "--model", str(zamba2_two_blocks), "--variants", "swiglu", "--d-model", "64", *TOKENS,
                 "--schemes", "fp32,w8a8", "--runtimes", "none", "--no-onnx", "--out", str(tmp_path / "run")]) == 0
    capsys.readouterr()
    got = json.loads((tmp_path / "run" / "report.json").read_text())["model"]["end_to_end"]["schemes"]
    assert [s["end_to_end"]["hidden_sqnr_db"] for s in got if s["scheme"] == "w8a8"] == [want["hidden_sqnr_db"]]
