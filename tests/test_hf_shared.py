"""One FFN that several layers call (Zamba's shared transformer, its Parameters tied and stored once): quantized
once from every call's inputs, the same quantized FFN in every call (the engine's streams, the plan's search and
verification, the export), its norm's input scale folded once, and the folder proven."""

from __future__ import annotations

import json

import pytest
import torch

from ffnquant.cli import main
from ffnquant.hf import inspect_model, load_ffn_layers
from ffnquant.hf.inputs import LayerInputs
from ffnquant.hf.layers import quantize_layers, quantized_layers
from ffnquant.planning.planfile import Plan, model_fingerprint
from ffnquant.recipe import Recipe

T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")

TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128"]


@pytest.fixture(scope="module")
def zamba(tmp_path_factory):
    from hf_models import tiny_or_skip

    return tiny_or_skip("zamba", tmp_path_factory.mktemp("shared") / "zamba")


def _inputs(labels, seed=0):
    g = torch.Generator().manual_seed(seed)
    # the second call sees a wider input: its range moves a static input scale
    calib = {label: torch.randn(64, 32, generator=g) * (1 + 3 * k) for k, label in enumerate(labels)}
    held = {label: torch.randn(16, 32, generator=g) for label in labels}
    return LayerInputs(calib, held, "calib", "held", "different texts", {})


def test_a_shared_ffn_is_quantized_once_from_every_calls_inputs(zamba):
    info = inspect_model(zamba)
    layers = load_ffn_layers(info)
    inputs = _inputs([layer.label for layer in layers])
    rows, qffns = quantized_layers(info, layers, inputs, Recipe.parse("w8a8"), onnx=False, sensitivity=False)
    assert qffns["L0"] is qffns["L1"]
    assert [r.get("shares") for r in rows] == [None, "L0"] and rows[0]["n_calib_tokens"] == 128
    pooled = LayerInputs({"L0": torch.cat([inputs.calib["L0"], inputs.calib["L1"]])}, {"L0": inputs.eval["L0"]},
                         "calib", "held", "", {})
    alone = next(quantize_layers(layers[:1], [Recipe.parse("w8a8")], pooled)).result.qmodel
    first_only = next(quantize_layers(layers[:1], [Recipe.parse("w8a8")], inputs)).result.qmodel
    state, want = qffns["L0"].state_dict(), alone.state_dict()
    assert want and state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)
    assert qffns["L0"].ranges == alone.ranges  # the static input ranges: from both calls' rows
    assert qffns["L0"].ranges != first_only.ranges  # not the first call's alone


def test_a_plan_giving_one_ffns_calls_two_recipes_is_refused_in_one_line(zamba, tmp_path, capsys):
    info = inspect_model(zamba)
    plan = tmp_path / "two.toml"
    plan.write_text(Plan(model_fingerprint(info), {0: Recipe.parse("w8a8"), 1: Recipe.parse("w4a16-g32")},
                         "ppl+1%", "latency").to_toml())
    rc = main(["export", "--model", str(zamba), "--plan", str(plan), "--format", "compressed-tensors", *TOKENS,
               "--out", str(tmp_path / "ct")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "they call one FFN (its weights shared)" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "ct").exists()


def test_the_engine_quantizes_at_the_last_call_and_every_call_computes_with_it(zamba, tmp_path, capsys):
    """The quantized streams wait before the first call until the last call's inputs are in; resident and read a
    layer at a time, the same figures bit for bit, each call's row the one quantization's."""
    docs = []
    for mode in ([], ["--sequential"]):
        out = tmp_path / ("q" + "".join(mode))
        assert main(["quantize", "--model", str(zamba), "--scheme", "w8a8", *TOKENS, "--no-onnx", "--no-progress",
                     *mode, "--out-reports", str(out)]) == 0
        assert "L1 calls L0's" in capsys.readouterr().out
        docs.append(json.loads(next(out.glob("*.json")).read_text()))
    for doc in docs:
        first, second = doc["layers"]
        assert second["shares"] == "L0" and first["accuracy_torch"] == second["accuracy_torch"]
        assert first["n_calib_tokens"] == doc["calibration"]["tokens"]["obtained"] * 2  # both calls' rows
    resident, streamed = (d["end_to_end"]["end_to_end"] for d in docs)
    assert resident == streamed and [a["perplexity"] for a in docs[0]["end_to_end"]["ablation"]] == \
        [a["perplexity"] for a in docs[1]["end_to_end"]["ablation"]]


def test_the_plan_ties_the_calls_counts_their_bytes_once_and_the_export_is_proven(zamba, tmp_path, capsys):
    plan = tmp_path / "p"
    assert main(["plan", "--model", str(zamba), "--target", "ppl+5%", "--objective", "bytes",
                 "--candidates", "fp32,w8a8@search+smooth,w4a16-g32", *TOKENS, "--seq-len", "128",
                 "--probe-tokens", "128", "--no-progress", "--out", str(plan)]) == 0
    data = json.loads((plan / "plan.json").read_text())
    chosen = {row["index"]: row["recipe"] for row in data["plan"]["layers"]}
    assert chosen[0] == chosen[1]
    by_layer = {int(i): {c["recipe"]: c["bytes"] for c in row["candidates"]} for i, row in data["layers"].items()}
    assert by_layer[1][chosen[1]] == 0 and data["plan"]["summary"]["cost"] == by_layer[0][chosen[0]]
    capsys.readouterr()
    # smoothing on both calls: one input scale, folded once into the shared norm (twice, the gates failed)
    smoothed = tmp_path / "smoothed.toml"
    info = inspect_model(zamba)
    smoothed.write_text(Plan(model_fingerprint(info), {0: Recipe.parse("w8a8@search+smooth"),
                                                       1: Recipe.parse("w8a8@search+smooth")},
                             "ppl+1%", "latency").to_toml())
    for name, path in (("smoothed", smoothed), ("planned", plan / "plan.toml")):
        rc = main(["export", "--model", str(zamba), "--plan", str(path), "--format", "compressed-tensors", *TOKENS,
                   "--seq-len", "128", "--no-progress", "--out", str(tmp_path / name)])
        assert rc == 0, capsys.readouterr()
        proof = json.loads((tmp_path / name / "ffnquant-deploy.json").read_text())["proof"]
        assert proof["proven"] and proof["weights"]["all_identical"] and proof["layers"]["all_at_parity"]


def _scaled(layer, c):
    """The layer's FFN with x * c before it and 1/c in its input weight columns: the same function."""
    import copy

    from ffnquant.numerics.remedies import ChannelScale

    ffn = copy.deepcopy(layer.ffn)
    ffn.input_transform = ChannelScale(c)
    with torch.no_grad():
        for lin in [ffn.w_up] + ([ffn.w_gate] if ffn.w_gate is not None else []):
            lin.weight.div_(c[None, :])
    return ffn


def test_one_input_scale_is_folded_once_into_a_shared_norm_and_two_are_refused(zamba):
    """The calls of one FFN read one norm (one Parameter under each call's name): its input scale is folded once,
    the gain multiplied by it and not its square; two different scales for it cannot be one gain."""
    from ffnquant.errors import FFNQuantError
    from ffnquant.hf.capture import load_hf_model
    from ffnquant.hf.fold import fold_input_scales

    info = inspect_model(zamba)
    layers = load_ffn_layers(info)
    model = load_hf_model(info)
    norm = model.model.layers[0].shared_transf.pre_ff_layernorm.weight
    assert norm is model.model.layers[1].shared_transf.pre_ff_layernorm.weight
    before = norm.detach().clone()
    c = torch.linspace(0.5, 2.0, info.spec.d_model)
    with pytest.raises(FFNQuantError, match=r"layers L0 and L1 both read the norm gain of .* with different input scales"):
        fold_input_scales(model, info, {layers[0].info: _scaled(layers[0], c), layers[1].info: _scaled(layers[1], 2 * c)})
    assert torch.equal(norm, before)  # checked before any weight changes
    fold_input_scales(model, info, {layer.info: _scaled(layer, c) for layer in layers})
    assert torch.allclose(norm, before * c, rtol=1e-6)


def test_a_later_calls_stored_copy_that_differs_from_the_first_fails_the_proof(zamba, tmp_path, monkeypatch, capsys):
    """A later call's packed tensors are stored under its own names (transformers ties only `weight`): the proof
    checks each against the first call's, bit for bit, so a copy a runtime reading it would compute otherwise with
    (vLLM reads every module's own tensors) is NOT PROVEN, though transformers, tying the weight, loads it fine."""
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    import ffnquant.deploy.ctensors as ct

    write = ct.write_folder
    name = "model.layers.1.shared_transf.feed_forward.down_proj.weight_scale"

    def corrupt(planned, folder):
        out = write(planned, folder)
        path = Path(folder) / "model.safetensors"
        tensors = load_file(str(path))
        tensors[name] = tensors[name] * 2
        save_file(tensors, str(path), metadata={"format": "pt"})
        return out

    monkeypatch.setattr(ct, "write_folder", corrupt)
    info = inspect_model(zamba)
    plan = tmp_path / "w4.toml"
    plan.write_text(Plan(model_fingerprint(info), {0: Recipe.parse("w4a16-g32"), 1: Recipe.parse("w4a16-g32")},
                         "ppl+1%", "latency").to_toml())
    rc = main(["export", "--model", str(zamba), "--plan", str(plan), "--format", "compressed-tensors", *TOKENS,
               "--seq-len", "128", "--no-progress", "--out", str(tmp_path / "ct")])
    assert rc == 1 and "NOT PROVEN" in capsys.readouterr().out
    proof = json.loads((tmp_path / "ct.not-proven" / "ffnquant-deploy.json").read_text())["proof"]
    rows = {r["module"]: r for r in proof["weights"]["rows"]}
    assert not rows["model.layers.1.shared_transf.feed_forward.down_proj"]["bit_identical"]
    assert "DIFFER from the first call's" in rows["model.layers.1.shared_transf.feed_forward.down_proj"]["how"]
    assert rows["model.layers.0.shared_transf.feed_forward.down_proj"]["bit_identical"]


@pytest.mark.parametrize("command", ["quantize", "run"])
def test_selecting_some_calls_of_a_shared_ffn_is_refused_in_one_line(zamba, tmp_path, capsys, command):
    """The model stores the FFN once: quantized in one call and float in another is no model that can be
    deployed, so `--layers 0` alone is refused before the model is read, naming the calls to select."""
    out = tmp_path / "out"
    argv = (["quantize", "--model", str(zamba), "--scheme", "w4a16-g32", "--layers", "0", *TOKENS, "--no-onnx",
             "--no-progress", "--out-reports", str(out)] if command == "quantize" else
            ["run", "--model", str(zamba), "--layers", "0", "--variants", "swiglu", "--d-model", "64", *TOKENS,
             "--schemes", "fp32,w4a16-g32", "--runtimes", "none", "--no-onnx", "--out", str(out)])
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--layers selects L0 but not L1, which call the same FFN" in err and "(0,1) or none" in err
    assert len(err.splitlines()) == 1 and not out.exists()


def test_the_calls_of_a_shared_ffn_hold_one_copy_of_its_weights(zamba):
    """As the model does: a later call's FFN computes with the first call's tensors (the engine holds every call
    until the last one's inputs are in: one copy, not one per call)."""
    layers = load_ffn_layers(inspect_model(zamba))
    first, later = (layer.ffn.weights() for layer in layers)
    assert all(first[n].data_ptr() == later[n].data_ptr() for n in first)
    only_later = load_ffn_layers(inspect_model(zamba), [1])[0].ffn.weights()  # read alone: its own copy, equal
    assert all(torch.equal(only_later[n], first[n]) for n in first)
