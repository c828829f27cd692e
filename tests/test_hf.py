"""ffnquant.hf: tiny random Hugging Face models built locally (no downloads), saved as safetensors folders."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.hf import inspect_model, load_ffn_layers, parse_layers
from ffnquant.hf.arch import HF_ACTIVATIONS, ffn_variant, hf_activation
from ffnquant.spec import Activation, FFNSpec, Variant

from hf_models import D, F_, VOCAB, tiny_folders
from hf_models import write_llama_like as _write_llama_like

ARCH_IDS = ["llama", "mistral", "qwen2", "gemma", "phi3", "mixtral", "t5", "t5-gated-gelu", "gpt2", "bert", "opt"]


# --- no transformers needed ---------------------------------------------------------------


def test_activation_override_roundtrip_and_key():
    spec = FFNSpec("geglu", d_model=D, d_ff=F_, activation_override="gelu_tanh")
    assert spec.activation is Activation.GELU_TANH and spec.key.endswith("_act-gelu_tanh")
    assert FFNSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    # the variant's own activation is no override: same spec, same key and JSON as before
    plain = FFNSpec("geglu", d_model=D, d_ff=F_, activation_override="gelu")
    assert plain == FFNSpec("geglu", d_model=D, d_ff=F_) and "activation_override" not in plain.to_dict()
    with pytest.raises(FFNQuantError, match="unknown activation 'tanhh'"):
        FFNSpec("geglu", activation_override="tanhh")


def test_activation_override_changes_ffn_math():
    from ffnquant.model import build

    spec = FFNSpec("geglu", d_model=D, d_ff=F_, activation_override="gelu_tanh")
    model = build(spec, seed=1)
    x = torch.randn(5, D)
    gate, up = model.w_gate(x), model.w_up(x)
    expect = model.w_down(torch.nn.functional.gelu(gate, approximate="tanh") * up)
    torch.testing.assert_close(model(x), expect, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(HF_ACTIVATIONS), ids=str)
def test_hf_activation_names_match_transformers(name):
    acts = pytest.importorskip("transformers.activations", reason="transformers not installed")
    from ffnquant.model import ACTIVATIONS

    x = torch.linspace(-6, 6, 2001, dtype=torch.float64)
    ours = ACTIVATIONS[hf_activation(name, "test")](x)
    torch.testing.assert_close(acts.ACT2FN[name](x), ours, rtol=0, atol=1e-9)


def test_relu_squared_is_transformers_bit_for_bit():
    """Nemotron's and Arcee's ReLU^2 (transformers' `relu2`, ReLUSquaredActivation): the same two operations, so the
    same float32 bits; a dense FFN with it is ReLU's variant with the override, a gated one ReGLU's."""
    acts = pytest.importorskip("transformers.activations", reason="transformers not installed")
    from ffnquant.model import ACTIVATIONS, build
    from ffnquant.spec import FFNSpec

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(acts.ACT2FN["relu2"](x), ACTIVATIONS[Activation.RELU2](x))
    assert ffn_variant(Activation.RELU2, gated=False, where="x") == (Variant.RELU, Activation.RELU2)
    assert ffn_variant(Activation.RELU2, gated=True, where="x")[0] is Variant.REGLU
    spec = FFNSpec("relu", d_model=8, d_ff=32, activation_override="relu2")
    assert spec.activation is Activation.RELU2 and FFNSpec.from_dict(spec.to_dict()) == spec
    model = build(spec, seed=0)
    h = torch.randn(5, 8)
    want = model.w_down(torch.relu(model.w_up(h)) ** 2)
    torch.testing.assert_close(model(h), want, rtol=1e-6, atol=1e-6)


def test_unrepresentable_activation_is_named():
    with pytest.raises(FFNQuantError, match="'quick_gelu' cannot be represented"):
        hf_activation("quick_gelu", "config.json")
    with pytest.raises(FFNQuantError, match="dense FFN with activation 'sigmoid'"):
        ffn_variant(Activation.SIGMOID, gated=False, where="config.json")
    assert ffn_variant(Activation.GELU_TANH, gated=True, where="x")[0] is Variant.GEGLU


@pytest.mark.parametrize(
    "text,n,expect",
    [("all", 4, [0, 1, 2, 3]), ("0-2", 4, [0, 1, 2]), ("3,1", 4, [1, 3]), ("0-1,3", 4, [0, 1, 3]), (None, 2, [0, 1])],
    ids=str,
)
def test_parse_layers(text, n, expect):
    assert parse_layers(text, n) == expect


@pytest.mark.parametrize("given, calibrator, measured", [
    ("w8a8+float=hidden", "mse", "w8a8@mse+float=hidden"), ("w8a8@minmax+smooth", "mse", "w8a8@minmax+smooth"),
    ("w8a8+smooth+rotate", "percentile", "w8a8@percentile+smooth+rotate"), ("w4a16-g32", "mse", "w4a16-g32")],
    ids=["float-site-kept", "own-calibrator-kept", "remedies-kept", "weight-only-untouched"])
def test_model_eval_gives_the_calibrator_to_the_whole_recipe(given, calibrator, measured):
    """`model eval --schemes ... --calibrator C` measures each recipe as written plus C: its float site and
    remedies kept (it once rebuilt the recipe without `+float=SITE`, measuring plain w8a8@C)."""
    from ffnquant.hf.evaluate import _recipes

    assert [str(r) for r in _recipes([given], calibrator)] == [measured]


@pytest.mark.parametrize("text,msg", [("5", "out of range"), ("2-1", "is empty"), ("a", "is not N, A-B")], ids=str)
def test_parse_layers_errors(text, msg):
    with pytest.raises(FFNQuantError, match=msg):
        parse_layers(text, 4)


def test_loader_without_transformers(tmp_path):
    state = _write_llama_like(tmp_path / "m")
    info = inspect_model(tmp_path / "m")
    assert info.spec == FFNSpec("swiglu", d_model=D, d_ff=F_, bias=False)
    assert [l.name for l in info.layers] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    (layer,) = load_ffn_layers(tmp_path / "m", layers="1")
    assert layer.index == 1 and layer.expert is None and layer.activation == "silu"
    torch.testing.assert_close(layer.ffn.w_gate.weight, state["model.layers.1.mlp.gate_proj.weight"])
    torch.testing.assert_close(layer.ffn.w_down.weight, state["model.layers.1.mlp.down_proj.weight"])


def test_sharded_index(tmp_path):
    from safetensors.torch import save_file

    state = _write_llama_like(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / "m" / shard))
        weight_map.update({k: shard for k in keys})
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    layers = load_ffn_layers(tmp_path / "m")
    assert len(layers) == 2
    torch.testing.assert_close(layers[1].ffn.w_up.weight, state["model.layers.1.mlp.up_proj.weight"])
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FFNQuantError, match="names shard 'model-00002-of-00002.safetensors', which is missing"):
        inspect_model(tmp_path / "m")


def _bad_folder_cases():
    def missing_config(p):
        (p / "config.json").unlink()

    def unsupported(p):
        cfg = json.loads((p / "config.json").read_text())
        (p / "config.json").write_text(json.dumps(dict(cfg, model_type="mamba")))

    def corrupt(p):
        data = (p / "model.safetensors").read_bytes()
        (p / "model.safetensors").write_bytes(data[: len(data) // 3])

    def garbage(p):
        (p / "model.safetensors").write_bytes(b"\x00\x01not a safetensors file")

    def shape(p):
        cfg = json.loads((p / "config.json").read_text())
        (p / "config.json").write_text(json.dumps(dict(cfg, intermediate_size=F_ * 2)))

    def missing_layer(p):
        cfg = json.loads((p / "config.json").read_text())
        (p / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=3)))

    def pickle_only(p):
        (p / "model.safetensors").unlink()
        torch.save({"x": torch.zeros(1)}, p / "pytorch_model.bin")

    def no_weights(p):
        (p / "model.safetensors").unlink()

    return [
        pytest.param(missing_config, r"config\.json' is missing", id="missing-config"),
        pytest.param(unsupported, r"mixer: ffnquant cannot reproduce this FFN's output", id="unsupported"),
        pytest.param(corrupt, r"cannot read safetensors file '.*model\.safetensors'", id="truncated"),
        pytest.param(garbage, r"cannot read safetensors file '.*model\.safetensors'", id="garbage"),
        pytest.param(shape, r"tensor 'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape \[\d+, \d+\], but the model transformers builds "
                     r"from config\.json has \[\d+, \d+\]", id="shape"),
        pytest.param(missing_layer, r"no llama FFN tensors for layer 2", id="missing-layer"),
        pytest.param(pickle_only, r"pytorch_model\.bin' is a pickled PyTorch checkpoint.*allow_pickle=True", id="pickle-refused"),
        pytest.param(no_weights, r"has no weights: expected model\.safetensors", id="no-weights"),
    ]


@pytest.mark.parametrize("break_it,message", _bad_folder_cases())
def test_bad_folders_give_one_line_errors(tmp_path, break_it, message):
    _write_llama_like(tmp_path / "m")
    break_it(tmp_path / "m")
    with pytest.raises(FFNQuantError, match=message) as exc:
        load_ffn_layers(tmp_path / "m")
    assert "\n" not in str(exc.value)


def test_pickle_opt_in_uses_weights_only(tmp_path):
    state = _write_llama_like(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(state, tmp_path / "m" / "pytorch_model.bin")
    layers = load_ffn_layers(tmp_path / "m", allow_pickle=True)
    torch.testing.assert_close(layers[0].ffn.w_up.weight, state["model.layers.0.mlp.up_proj.weight"])
    assert inspect_model(tmp_path / "m", allow_pickle=True).weights_format == "pickle"


def test_missing_folder(tmp_path):
    with pytest.raises(FFNQuantError, match="does not exist or is not a folder"):
        inspect_model(tmp_path / "nope")


# --- tiny transformers models -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Every listed architecture, 2 layers, hidden 32, saved with save_pretrained(safe_serialization=True)."""
    return tiny_folders(tmp_path_factory)


def _reference_mlp_outputs(name, model, info, x):
    """Each FFN's output computed by the transformers model's own modules."""
    from ffnquant.hf.capture import _module_for, _resolve_attr

    names = [n for n, _ in model.named_modules()]
    outs = {}
    for layer in info.layers:
        _, module = _module_for(model, info, layer, names)
        if info.arch.split_attrs[0]:
            first = _resolve_attr(module, info.arch.split_attrs[0])
            act = _resolve_attr(module, info.arch.split_attrs[1])
            second = _resolve_attr(module, info.arch.split_attrs[2])
            h = getattr(*act)(getattr(*first)(x))
            outs[layer.label] = getattr(*second)(h)
        elif info.arch.name == "mixtral":
            e = layer.expert
            gate, up = torch.nn.functional.linear(x, module.gate_up_proj[e]).chunk(2, dim=-1)
            outs[layer.label] = torch.nn.functional.linear(module.act_fn(gate) * up, module.down_proj[e])
        else:
            outs[layer.label] = module(x)
    return outs


@pytest.mark.hf
@pytest.mark.parametrize("name", ARCH_IDS, ids=str)
def test_detects_and_reproduces_the_models_mlp(tiny_models, name):
    from ffnquant.hf.capture import load_hf_model

    folder, variant, act = tiny_models[name]
    info = inspect_model(folder)
    assert info.spec.variant.value == variant and info.spec.activation.value == act
    assert (info.spec.d_model, info.spec.d_ff) == (D, F_)
    n_stacks = 2 if name.startswith("t5") else 1
    assert info.n_layers == 2 * n_stacks
    assert len(info.layers) == info.n_layers * (4 if name == "mixtral" else 1)
    layers = load_ffn_layers(folder)
    model = load_hf_model(info)
    x = torch.randn(7, D)
    with torch.no_grad():
        ref = _reference_mlp_outputs(name, model, info, x)
        for layer in layers:
            torch.testing.assert_close(layer.ffn(x), ref[layer.label], rtol=1e-5, atol=1e-5)


@pytest.mark.hf
@pytest.mark.parametrize("name", ARCH_IDS, ids=str)
def test_installed_float_ffns_leave_the_model_unchanged(tiny_models, name):
    from ffnquant.hf.capture import install_ffns, load_hf_model
    from ffnquant.hf.evaluate import _run

    folder, _, _ = tiny_models[name]
    info = inspect_model(folder)
    layers = load_ffn_layers(info)
    model = load_hf_model(info)
    ids = torch.randint(3, VOCAB, (2, 12))
    ref = _run(model, info, ids)
    with install_ffns(model, info, {layer.info: layer.ffn for layer in layers}):
        got = _run(model, info, ids)
    again = _run(model, info, ids)  # restored afterwards
    key = "last_hidden_state" if name == "bert" else "logits"
    torch.testing.assert_close(getattr(got, key), getattr(ref, key), rtol=1e-5, atol=1e-5)
    assert torch.equal(getattr(again, key), getattr(ref, key))
    # a replacement really computes: zeroing the last layer's FFNs changes the output
    last = max(layer.index for layer in layers)
    with install_ffns(model, info, {l.info: (lambda x: torch.zeros_like(x)) for l in layers if l.index == last}):
        zeroed = _run(model, info, ids)
    assert not torch.allclose(getattr(zeroed, key), getattr(ref, key), atol=1e-3)


@pytest.mark.hf
@pytest.mark.parametrize("name", ["llama", "mixtral", "bert", "t5-gated-gelu"], ids=str)
def test_capture_feeds_observers_like_a_direct_computation(tiny_models, name):
    from ffnquant.hf.capture import iter_captured, load_hf_model, load_tokenizer, read_text, text_batches
    from ffnquant.hf.evaluate import calibrate_layers
    from ffnquant.numerics.observe import TensorObserver

    folder, _, _ = tiny_models[name]
    info = inspect_model(folder)
    layers = load_ffn_layers(info)
    model = load_hf_model(info)
    batches = text_batches(load_tokenizer(folder), read_text(None, "calibration"), seq_len=16, batch_size=2, max_tokens=96)
    captured = list(iter_captured(model, info, [l.info for l in layers], batches))
    # direct computation: the same inputs through hooks on the model's own MLP modules
    direct: dict[str, list[torch.Tensor]] = {}
    from ffnquant.hf.capture import _module_for

    names = [n for n, _ in model.named_modules()]
    if name != "mixtral":
        handles = []
        for layer in info.layers:
            _, module = _module_for(model, info, layer, names)
            target = module.intermediate.dense if name == "bert" else module
            handles.append(target.register_forward_pre_hook(
                lambda m, a, lab=layer.label: direct.setdefault(lab, []).append(a[0].reshape(-1, D).clone())))
        with torch.no_grad():
            from ffnquant.hf.evaluate import _run

            for ids in batches:
                _run(model, info, ids)
        for h in handles:
            h.remove()
        for label, xs in direct.items():
            torch.testing.assert_close(torch.cat([c[label] for c in captured]), torch.cat(xs))
    else:  # the router sends every token to exactly top_k = 2 experts of each layer
        for c, ids in zip(captured, batches):
            for i in range(2):
                assert sum(x.shape[0] for k, x in c.items() if k.startswith(f"L{i}.")) == 2 * ids.numel()
    tables, _ = calibrate_layers(layers, captured, bins=256)
    for layer in layers:
        xs = [c[layer.label] for c in captured if layer.label in c]
        if not xs:
            continue
        x = torch.cat(xs)
        obs = TensorObserver(256).update(x)
        got = tables[layer.label]["input"]
        assert got.n == obs.n == x.numel()
        assert got.max == pytest.approx(float(x.max()), rel=1e-6) and got.min == pytest.approx(float(x.min()), rel=1e-6)
        # float32 batch sums against one float64 sum: agreement to 1e-6 of the spread
        assert got.mean == pytest.approx(float(x.double().mean()), abs=1e-6 * float(x.double().std()))
        with torch.no_grad():
            out = layer.ffn(x)
        assert tables[layer.label]["output"].absmax == pytest.approx(float(out.abs().max()), rel=1e-5)


@pytest.mark.hf
def test_captured_files_roundtrip(tiny_models, tmp_path):
    from ffnquant.hf.capture import (
        iter_captured, iter_captured_files, load_hf_model, load_tokenizer, read_text, save_captured, text_batches,
    )

    folder, _, _ = tiny_models["gpt2"]
    info = inspect_model(folder)
    layers = [l.info for l in load_ffn_layers(info)]
    model = load_hf_model(info)
    batches = text_batches(load_tokenizer(folder), read_text(None, "calibration"), seq_len=16, batch_size=2, max_tokens=80)
    captured = list(iter_captured(model, info, layers, batches))
    files = save_captured(tmp_path / "cap", iter(captured), D)
    assert sorted(files) == ["L0", "L1"] and not list((tmp_path / "cap").glob(".*"))  # no temp files left
    for label in files:
        want = torch.cat([c[label] for c in captured])
        got = torch.cat([x for lab, x in iter_captured_files(tmp_path / "cap", [label], D, chunk_tokens=7)])
        assert torch.equal(got, want) and got.shape == (80, D)
    with pytest.raises(FFNQuantError, match="no captured activations for layer L5"):
        list(iter_captured_files(tmp_path / "cap", ["L5"], D))
    with pytest.raises(FFNQuantError, match="last dimension 32, expected d_model 16"):
        list(iter_captured_files(tmp_path / "cap", ["L0"], 16))


@pytest.mark.hf
@pytest.mark.parametrize("name", ["opt", "bert"], ids=str)
def test_evaluate_model_end_to_end(tiny_models, name):
    from ffnquant.hf.evaluate import EvalSettings, evaluate_model

    folder, _, _ = tiny_models[name]
    settings = EvalSettings(seq_len=16, batch_size=4, max_calib_tokens=128, max_eval_tokens=64)
    result = evaluate_model(folder, ["fp32", "w8a8", "w4a16-g32", "w4a16-g128"], settings=settings)
    json.dumps(result, allow_nan=False)  # the report is plain JSON
    by = {s["scheme"]: s for s in result["schemes"]}
    assert result["skipped"] == []  # group 128 is wider than d_model 32: one zero-padded group, not a refusal
    # fp32 quantizes nothing: the model is bit-identical to the float one
    assert by["fp32"]["end_to_end"]["hidden_sqnr_db"] == 200.0
    assert all(r["sqnr_db"] == 200.0 for r in by["fp32"]["layers"])
    # 8-bit: ~6 dB per bit, minus the crest factor of the ranges; 4-bit groups much worse
    w8 = [r["sqnr_db"] for r in by["w8a8"]["layers"]]
    w4 = [r["sqnr_db"] for r in by["w4a16-g32"]["layers"]]
    assert min(w8) > 25 and max(w4) < min(w8) - 10
    assert by["w8a8"]["end_to_end"]["hidden_sqnr_db"] > by["w4a16-g32"]["end_to_end"]["hidden_sqnr_db"]
    assert len(by["w8a8"]["ablation"]) == 2 and len(by["w8a8"]["worst_layers_sqnr"]) == 2
    if name == "opt":
        assert result["baseline"]["perplexity"] > 1
        assert by["fp32"]["end_to_end"]["perplexity_delta"] == 0.0
        assert abs(by["w8a8"]["end_to_end"]["perplexity_delta"]) < abs(by["w4a16-g32"]["end_to_end"]["perplexity_delta"]) + 1e-3
    else:
        assert result["baseline"]["perplexity"] is None and "perplexity" not in by["w8a8"]["end_to_end"]


@pytest.mark.hf
def test_cli_model_inspect_and_eval(tiny_models, tmp_path, capsys):
    from ffnquant.cli import main

    folder, _, _ = tiny_models["mixtral"]
    assert main(["model", "inspect", str(folder), "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "swiglu" in out and "4 experts each" in out and "L1.e3" in out and "L0.e0" not in out
    assert main(["model", "eval", str(folder), "--schemes", "w8a8-dynamic", "--seq-len", "16", "--max-calib-tokens", "64",
                 "--max-eval-tokens", "32", "--no-ablation", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "model-mixtral.json").read_text())
    assert report["model"]["n_ffns"] == 8 and "environment" in report
    assert "## w8a8-dynamic: per layer" in (tmp_path / "model-mixtral.md").read_text()
    assert main(["model", "inspect", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_per_layer_evaluation_from_files_needs_no_transformers(tmp_path):
    """The no-transformers path: captured inputs in .npy files, per-layer SQNR per scheme."""
    from ffnquant.hf.evaluate import calibrate_model, evaluate_layers_from_files

    _write_llama_like(tmp_path / "m")
    gen = np.random.default_rng(0)
    for split in ("calib", "eval"):
        (tmp_path / split).mkdir()
        for label in ("L0", "L1"):
            np.save(tmp_path / split / f"{label}.npy", gen.standard_normal((300, D)).astype(np.float32))
    layers, tables = calibrate_model(tmp_path / "m", captured=tmp_path / "calib")
    assert [l.label for l in layers] == ["L0", "L1"] and tables["L1"].n_tokens == 300
    result = evaluate_layers_from_files(tmp_path / "m", ["w8a8-dynamic", "w4a16-g32"], tmp_path / "calib", tmp_path / "eval")
    by = {s["scheme"]: s for s in result["schemes"]}
    assert all(r["n_eval_tokens"] == 300 for r in by["w8a8-dynamic"]["layers"])
    assert min(r["sqnr_db"] for r in by["w8a8-dynamic"]["layers"]) > max(r["sqnr_db"] for r in by["w4a16-g32"]["layers"]) + 10
    assert by["w4a16-g32"]["end_to_end"] is None and "end_to_end_unavailable" in result


# --- model folders that must be refused in one line: special files, permissions, escapes, pickles ---------


@pytest.fixture
def no_hang():
    """Fail a test that blocks (a FIFO opened for reading) instead of hanging the suite."""
    import signal

    def timeout(signum, frame):
        raise AssertionError("blocked for 20 s: a special file was opened")

    old = signal.signal(signal.SIGALRM, timeout)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def _sharded(p):
    """Turn the folder's model.safetensors into two shards and an index."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(p / "model.safetensors"))
    (p / "model.safetensors").unlink()
    names = sorted(state)
    weight_map = {}
    for i, keys in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: state[k] for k in keys}, str(p / shard))
        weight_map.update({k: shard for k in keys})
    (p / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def _replace_with_fifo(path):
    import os

    if path.exists():
        path.unlink()
    os.mkfifo(path)


def _pickled(p):
    from safetensors.torch import load_file

    torch.save(load_file(str(p / "model.safetensors")), p / "pytorch_model.bin")
    (p / "model.safetensors").unlink()


@pytest.mark.parametrize(
    "prepare, name",
    [
        pytest.param(lambda p: None, "model.safetensors", id="weights"),
        pytest.param(lambda p: None, "config.json", id="config"),
        pytest.param(lambda p: None, "tokenizer.json", id="tokenizer"),
        pytest.param(lambda p: None, "special_tokens_map.json", id="tokenizer-extra"),
        pytest.param(_sharded, "model-00002-of-00002.safetensors", id="shard"),
        pytest.param(_sharded, "model.safetensors.index.json", id="index"),
        pytest.param(_pickled, "pytorch_model.bin", id="pickle"),
    ],
)
def test_special_files_in_a_model_folder_are_refused_not_opened(tmp_path, no_hang, prepare, name):
    _write_llama_like(tmp_path / "m")
    prepare(tmp_path / "m")
    _replace_with_fifo(tmp_path / "m" / name)
    with pytest.raises(FFNQuantError) as info:
        inspect_model(tmp_path / "m", allow_pickle=True)
    message = str(info.value)
    assert "\n" not in message and f"{name}' is a FIFO, not a regular file" in message, message


def _deny_open(monkeypatch, path):
    """Make opening `path` fail as it would without read permission (tests run as root, who reads mode 000)."""
    import builtins

    real_open = builtins.open

    def denied(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", denied)


@pytest.mark.parametrize(
    "prepare, name, what",
    [
        pytest.param(lambda p: None, "config.json", "model config", id="config"),
        pytest.param(lambda p: None, "model.safetensors", "weights file", id="weights"),
        pytest.param(_sharded, "model-00001-of-00002.safetensors", "weights file", id="shard"),
        pytest.param(_sharded, "model.safetensors.index.json", "safetensors index", id="index"),
        pytest.param(_pickled, "pytorch_model.bin", "weights file", id="pickle"),
    ],
)
def test_unreadable_model_files_are_named_in_one_line(tmp_path, monkeypatch, prepare, name, what):
    _write_llama_like(tmp_path / "m")
    prepare(tmp_path / "m")
    path = tmp_path / "m" / name
    _deny_open(monkeypatch, path)
    with pytest.raises(FFNQuantError) as info:
        inspect_model(tmp_path / "m", allow_pickle=True)
    assert str(info.value) == f"cannot read {what} {str(path)!r}: permission denied"


def test_unlistable_model_folder_is_named(tmp_path, monkeypatch):
    import os

    _write_llama_like(tmp_path / "m")
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p=".": (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
                        if str(p) == str(tmp_path / "m") else real(p))
    with pytest.raises(FFNQuantError, match=r"^cannot list model folder '.*m': permission denied$"):
        inspect_model(tmp_path / "m")


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root reads files of mode 000; the denied open is tested above by patching open")
def test_mode_000_config_is_refused(tmp_path):
    _write_llama_like(tmp_path / "m")
    (tmp_path / "m" / "config.json").chmod(0)
    with pytest.raises(FFNQuantError, match=r"cannot read model config '.*config\.json': permission denied$"):
        inspect_model(tmp_path / "m")


@pytest.mark.parametrize(
    "shard",
    [
        pytest.param("../outside/x.safetensors", id="parent"),
        pytest.param("sub/../../x.safetensors", id="nested-parent"),
        pytest.param("{outside}", id="absolute"),
        pytest.param("..\\x.safetensors", id="backslash-parent"),
        pytest.param("C:\\x.safetensors", id="windows-drive"),
        pytest.param("", id="empty"),
    ],
)
def test_sharded_index_pointing_outside_the_folder_is_refused(tmp_path, shard):
    from safetensors.torch import save_file

    state = _write_llama_like(tmp_path / "m")
    (tmp_path / "outside").mkdir()
    outside = tmp_path / "outside" / "x.safetensors"
    save_file(state, str(outside))  # a readable file out there: it must still not be read
    (tmp_path / "m" / "model.safetensors").unlink()
    shard = shard.replace("{outside}", str(outside))
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: shard for k in state}}))
    with pytest.raises(FFNQuantError) as info:
        inspect_model(tmp_path / "m")
    assert str(info.value).endswith(f"names shard {shard!r}, which is not a file name inside the model folder; "
                                    "shards must be files in the folder, named relative to it")


def test_index_with_shard_links_inside_the_folder_still_loads(tmp_path):
    """Hugging Face cache snapshots link each file to a blob outside the folder: names, not targets, are checked."""
    import os

    _write_llama_like(tmp_path / "m")
    weight_map = _sharded(tmp_path / "m")
    (tmp_path / "blobs").mkdir()
    for shard in sorted(set(weight_map.values())):
        (tmp_path / "m" / shard).rename(tmp_path / "blobs" / shard)
        os.symlink(tmp_path / "blobs" / shard, tmp_path / "m" / shard)
    assert len(load_ffn_layers(tmp_path / "m")) == 2


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("echo this must never run",))


class _Custom:
    def __init__(self):
        self.weights = torch.zeros(2)


@pytest.mark.parametrize("obj", [pytest.param({"x": _Payload()}, id="code"), pytest.param({"x": _Custom()}, id="object")])
def test_pickle_refused_by_weights_only_loading_is_one_line(tmp_path, obj):
    _write_llama_like(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    torch.save(obj, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(FFNQuantError) as info:
        inspect_model(tmp_path / "m", allow_pickle=True)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{str(tmp_path / 'm' / 'pytorch_model.bin')!r} holds objects "
                                                      "that weights-only loading refuses (")
    assert message.endswith("use a safetensors copy of the weights") and "weights_only" not in message
    assert "GLOBAL" in message  # torch's name of what was refused


def test_token_ids_beyond_the_vocabulary_are_refused(tmp_path):
    from ffnquant.hf.capture import check_token_ids

    _write_llama_like(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, vocab_size=50)))
    info = inspect_model(tmp_path / "m")
    check_token_ids(info, [torch.tensor([[0, 49]])], "the text")  # the last row of the embedding: fine
    with pytest.raises(FFNQuantError) as exc:
        check_token_ids(info, [torch.tensor([[3, 7]]), torch.tensor([[50, 1]])], "the calibration text")
    assert str(exc.value) == (
        f"the tokenizer of {str(tmp_path / 'm')!r} gives token id 50 on the calibration text, but config.json's "
        "vocab_size is 50 (the model's embedding rows, ids 0-49): the tokenizer does not belong to this model; "
        "save the model's own tokenizer into the folder")


@pytest.mark.hf
def test_tokenizer_beyond_the_vocabulary_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    """A folder whose tokenizer gives ids up to 95 while config.json says 40 embedding rows."""
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    from hf_models import tokenizer

    from ffnquant.hf import capture, evaluate

    _write_llama_like(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(cfg, vocab_size=40)))
    tokenizer(T).save_pretrained(tmp_path / "m")

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the tokenizer was checked")

    monkeypatch.setattr(evaluate, "load_hf_model", no_model)
    monkeypatch.setattr(capture, "load_hf_model", no_model)
    settings = evaluate.EvalSettings(seq_len=16, batch_size=2, max_calib_tokens=64, max_eval_tokens=32)
    with pytest.raises(FFNQuantError, match=r"gives token id \d+ on the calibration text, but config\.json's "
                                            r"vocab_size is 40 \(the model's embedding rows, ids 0-39\)"):
        evaluate.evaluate_model(tmp_path / "m", ["w8a8"], settings=settings)
    info = inspect_model(tmp_path / "m")
    with pytest.raises(FFNQuantError, match="gives token id .* on the evaluation text"):
        capture.check_tokenizer(info, {"evaluation": None})
    with pytest.raises(FFNQuantError, match="gives token id"):
        evaluate.capture_layer_inputs(info, load_ffn_layers(info), calib_tokens=64, eval_tokens=32, settings=settings)


@pytest.mark.hf
def test_model_too_big_to_load_is_refused_before_transformers_loads_it(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    from ffnquant.infra import resources
    from ffnquant.hf.capture import load_hf_model

    _write_llama_like(tmp_path / "m")
    monkeypatch.setattr(resources, "_UNCHECKED_BYTES", 0)  # the tiny model is far below the checked sizes
    monkeypatch.setattr(resources, "available_memory", lambda: 1000)
    n = sum(math.prod(t.shape) for t in _write_llama_like(tmp_path / "m").values())
    assert inspect_model(tmp_path / "m").n_params_total == n
    with pytest.raises(FFNQuantError, match=rf"the model '.*m' \({n:,} parameters in fp32\) needs .* to load; "
                                            r"this machine has 1\.0 kB available"):
        load_hf_model(tmp_path / "m")


def test_text_file_that_is_a_fifo_is_refused(tmp_path, no_hang):
    from ffnquant.hf.capture import read_text

    _replace_with_fifo(tmp_path / "text.txt")
    with pytest.raises(FFNQuantError, match=r"^text file '.*text\.txt' is a FIFO, not a regular file$"):
        read_text(tmp_path / "text.txt", "calibration")


@pytest.mark.parametrize("command", [["model", "inspect"], ["model", "eval", "--calib-captured", "{tmp}/cap",
                                                               "--eval-captured", "{tmp}/cap"]], ids=lambda c: c[1])
def test_cli_refuses_a_fifo_in_the_model_folder_with_exit_2(tmp_path, capsys, no_hang, command):
    from ffnquant.cli import main

    _write_llama_like(tmp_path / "m")
    _replace_with_fifo(tmp_path / "m" / "model.safetensors")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in command] + [str(tmp_path / "m")]
    if command[1] == "eval":
        argv += ["--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "model.safetensors' is a FIFO, not a regular file" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


# --- the model's own block arithmetic ------------------------------------------------------------


def _gqa_model(folder, d=576, f=1536, heads=9, kv_heads=3, layers=1):
    """A hand-written llama with grouped-query attention, the shapes of a 30-layer 576-wide trained LM's blocks."""
    _write_llama_like(folder, d=d, f=f, layers=layers)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(num_attention_heads=heads, num_key_value_heads=kv_heads)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_block_params_count_grouped_query_attention_from_config(tmp_path):
    info = inspect_model(_gqa_model(tmp_path / "m"))
    block = info.block_params()
    attn = block["attention"]
    assert (attn["d_model"], attn["n_heads"], attn["n_kv_heads"], attn["head_dim"]) == (576, 9, 3, 64)
    # q and o: 576 x 576 each; k and v: 576 x (3 heads x 64)
    assert attn["params"] == 2 * 576 * 576 + 2 * 576 * 192
    assert block["ffn_params_per_block"] == 3 * 576 * 1536
    assert block["ffn_share"] == pytest.approx(0.75)
    assert info.to_dict()["block_params"]["ffn_share"] == pytest.approx(0.75)
    # without a head count in config.json the attention is not guessed
    bare = inspect_model(_write_llama_like(tmp_path / "bare") and tmp_path / "bare").block_params()
    assert bare["attention"] is None and bare["ffn_share"] is None and "head count" in bare["reason"]


def test_ffn_share_claim_is_per_model_from_its_own_config(tmp_path):
    """The two-thirds claim: the synthetic family keeps its 4 d^2 arithmetic, the real model gets its own
    (75.0% with grouped-query attention, outside the band), never the family's 66.7%."""
    from ffnquant.data import TokenSource
    from ffnquant.hf import calibrate_model
    from ffnquant.ranges import claims, profile_variants

    folder = _gqa_model(tmp_path / "m")
    cap = tmp_path / "cap"
    cap.mkdir()
    np.save(cap / "L0.npy", np.random.default_rng(0).standard_normal((64, 576)).astype(np.float32))
    layers, by_label = calibrate_model(folder, captured=cap)
    tables = profile_variants([FFNSpec("swiglu", d_model=64)], TokenSource("gaussian", seed=0), 256, bins=64)
    tables.update({f"llama:{label}": t for label, t in by_label.items()})
    c = {x["id"]: x for x in claims(tables)}
    family = c["ffn_two_thirds"]
    assert list(family["figures"]["ffn_share"]) == ["swiglu"]  # the model's layers are not in the family's claim
    model = c["ffn_two_thirds:llama"]
    assert model["status"] == "contradicted" and model["figures"]["ffn_share"] == pytest.approx(0.75)
    assert "75.0%" in model["detail"] and "3 key/value heads" in model["detail"] and "d_model 576" in model["detail"]


@pytest.mark.hf
@pytest.mark.parametrize("name", ["llama", "mistral", "gemma", "mixtral", "bert"], ids=str)
def test_block_params_attention_matches_transformers(tiny_models, name):
    """The attention counted from config.json is the transformers model's own attention parameters."""
    import transformers

    folder, _, _ = tiny_models[name]
    info = inspect_model(folder)
    model = transformers.AutoModel.from_pretrained(str(folder), local_files_only=True)
    counted = info.block_params()["attention"]["params"]
    attn = next(m for n, m in model.named_modules() if n.endswith(("self_attn", "attention.self")))
    own = sum(p.numel() for p in attn.parameters())
    if name == "bert":  # BERT's output projection lives in attention.output.dense
        own += sum(p.numel() for p in model.encoder.layer[0].attention.output.dense.parameters())
    assert counted == own


def test_several_text_files_are_all_read(tmp_path):
    from ffnquant.hf.capture import read_text, text_label, text_paths

    a, b, c = (tmp_path / f"{n}.txt" for n in "abc")
    for p in (a, b, c):
        p.write_text(f"text {p.stem}", encoding="utf-8")
    odd = tmp_path / "with,comma.txt"
    odd.write_text("comma", encoding="utf-8")
    assert text_paths(f"{a},{b}", "calibration") == [a, b]
    assert text_paths([str(a), f"{b}, {c}"], "calibration") == [a, b, c]
    assert text_paths(str(odd), "calibration") == [odd]  # an existing file is one file, comma or not
    assert read_text(f"{a},{b},{c}", "calibration") == "text a\n\ntext b\n\ntext c"
    assert text_label([a, b], "calibration") == f"{a} + {b}"
    assert text_label(None, "evaluation") == "prose:evaluation (shipped corpus)"
    with pytest.raises(FFNQuantError, match="nope.txt"):
        read_text(f"{a},{tmp_path / 'nope.txt'}", "calibration")


def test_cli_text_options_accumulate():
    from ffnquant.cli import build_parser

    args = build_parser().parse_args(["quantize", "--model", "m", "--text", "a.txt", "--text", "b.txt,c.txt",
                                      "--eval-text", "d.txt"])
    assert (args.text, args.eval_text) == ("a.txt,b.txt,c.txt", "d.txt")


@pytest.mark.hf
def test_load_hf_model_keeps_transformers_loading_bar_off_stderr(tiny_models, capsys):
    import transformers

    from ffnquant.hf import load_hf_model

    tl = transformers.utils.logging
    tl.enable_progress_bar()
    capsys.readouterr()
    load_hf_model(tiny_models["llama"][0])
    assert "Loading weights" not in capsys.readouterr().err
    assert tl.is_progress_bar_enabled()  # the caller's setting is restored


def test_a_config_with_transformers_encoded_infinity_reads_as_the_float(tmp_path):
    """transformers writes a non-finite config value as {"__float__": "Infinity"} (JSON has none) and reads it back
    as the float (Falcon-H1's time_step_limit); so does `read_config`, which hands the values to transformers."""
    import json
    import math

    from ffnquant.hf.checkpoint import read_config

    (tmp_path / "config.json").write_text(json.dumps({"time_step_limit": [0.0, {"__float__": "Infinity"}],
                                                      "low": {"__float__": "-Infinity"}, "x": {"__float__": "NaN"},
                                                      "kept": {"__float__": "many"}}))
    config = read_config(tmp_path)
    assert config["time_step_limit"] == [0.0, math.inf] and config["low"] == -math.inf and math.isnan(config["x"])
    assert config["kept"] == {"__float__": "many"}  # not transformers' encoding: left as it is


def test_an_mlp_that_adds_the_residual_is_found_and_replaced_with_it():
    """BLOOM's and MPT's MLP forward(x, residual) returns FFN(x) + residual: discovery runs it with a zero residual,
    checks the residual is added as it is, and what replaces the module adds it the same way."""
    from torch import nn

    from ffnquant.hf.capture import _input_only
    from ffnquant.hf.probe import takes_residual

    class AddsResidual(nn.Module):
        def forward(self, hidden_states, residual):
            return hidden_states * 2 + residual

    class Plain(nn.Module):
        def forward(self, hidden_states, residual=None):
            return hidden_states

    assert takes_residual(AddsResidual()) and not takes_residual(Plain()) and not takes_residual(nn.Linear(2, 2))
    x, r = torch.randn(3, 4), torch.randn(3, 4)
    forward = _input_only(lambda h: h * 2, residual=True)
    assert torch.equal(forward(x, r), AddsResidual()(x, r)) and torch.equal(forward(x, residual=r), x * 2 + r)
    assert torch.equal(_input_only(lambda h: h * 2)(x, r), x * 2)


def test_experts_stored_under_names_transformers_renames_are_read_as_it_loads_them(tmp_path):
    """GraniteMoE's checkpoint stores its experts as block_sparse_moe.input_linear/output_linear, which transformers'
    conversion mapping renames to experts.gate_up_proj/down_proj at load: ffnquant reads the stored tensors under
    the loaded names, and each expert's matrices are the loaded model's own."""
    T = pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_models import save_causal_tiny, tokenizer

    try:
        folder = save_causal_tiny(T, "granitemoe", tmp_path / "m", tokenizer(T))
    except Exception as exc:  # a transformers without the type
        pytest.skip(f"granitemoe not buildable here: {exc}")
    info = inspect_model(folder)
    assert info.n_experts == 4 and len(info.layers) == 2 * 4
    assert info.layers[0].tensors["gate_up_proj"] == "model.layers.0.block_sparse_moe.experts.gate_up_proj"
    model = T.AutoModelForCausalLM.from_pretrained(folder)
    for layer in load_ffn_layers(info, [1]):
        experts = model.model.layers[1].block_sparse_moe.experts
        gate, up = experts.gate_up_proj[layer.expert].chunk(2, dim=0)
        assert torch.equal(layer.ffn.w_gate.weight, gate) and torch.equal(layer.ffn.w_up.weight, up)
        assert torch.equal(layer.ffn.w_down.weight, experts.down_proj[layer.expert])


@pytest.mark.parametrize("model_type, loaded", [
    ("inkling2_text", "mlp.experts.gate_up_proj"),  # stored interleaved as w13_weight (Interleave)
    ("hrm_text", "mlp.gate_proj.weight"),  # stored as one gate_up_proj, chunked (Chunk)
], ids=["interleaved", "chunked"])
def test_a_tensor_transformers_converts_as_it_loads_is_read_as_it_loads(tmp_path, model_type, loaded):
    """Inkling 2 stores its experts' gate and up rows interleaved (w13_weight), HRM its dense gate and up as one
    gate_up_proj: transformers reorders or splits them as it loads, and ffnquant reads each FFN matrix as the loaded
    model's own, bit for bit."""
    from hf_models import tiny_or_skip

    folder = tiny_or_skip(model_type, tmp_path / "m")
    T = pytest.importorskip("transformers")
    info = inspect_model(folder)
    layer = info.layers[-1]
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ffn = next(x for x in load_ffn_layers(info, [layer.index]) if x.expert == layer.expert).ffn
    module = model.get_submodule(layer.name)
    if info.n_experts:
        gate, up = module.gate_up_proj[layer.expert].chunk(2, dim=0)
        down = module.down_proj[layer.expert]
    else:
        gate, up, down = module.gate_proj.weight, module.up_proj.weight, module.down_proj.weight
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:  # stored under no such name
        assert not any(name.endswith(loaded) for name in fh.keys())
    assert torch.equal(ffn.w_gate.weight, gate) and torch.equal(ffn.w_up.weight, up)
    assert torch.equal(ffn.w_down.weight, down)


def test_experts_stored_per_expert_under_a_mapping_keyed_by_class_name_are_read(tmp_path):
    """Dots 3's checkpoint keeps experts.N.{gate,up,down}_proj, fused at load by the conversion mapping transformers
    keys by its text model's class name (Dots3NoteTextModel), not its model_type: ffnquant looks the mapping up as
    transformers does, and reads each expert's matrices as the loaded model's own."""
    from hf_models import tiny_or_skip

    folder = tiny_or_skip("dots3_note_text", tmp_path / "m")
    T = pytest.importorskip("transformers")
    info = inspect_model(folder)
    layer = next(layer for layer in info.layers if layer.expert == 2)
    assert layer.tensors["gate_proj.weight"] == f"model.layers.{layer.block}.mlp.experts.2.gate_proj.weight"
    model = T.AutoModelForCausalLM.from_pretrained(folder)
    loaded = next(x for x in load_ffn_layers(info, [layer.block]) if x.expert == 2)
    experts = model.model.layers[layer.block].mlp.experts
    gate, up = experts.gate_up_proj[2].chunk(2, dim=0)
    assert torch.equal(loaded.ffn.w_gate.weight, gate) and torch.equal(loaded.ffn.w_up.weight, up)
    assert torch.equal(loaded.ffn.w_down.weight, experts.down_proj[2])


@pytest.mark.parametrize("model_type, part", [
    # its token-shift mixes are two 3-D tensors [1, 1, d]: not experts, and its Linears still probed
    ("rwkv", r"feed_forward: ffnquant cannot reproduce this FFN's output.*parameters beside the FFN's matrices that "
             r"ffnquant's FFN does not compute: time_mix_key \[1, 1, 32\]"),
    # a convolution's [C, 1, K] is not called an experts' tensor
    ("mamba2", r"no FFN found in its 2 blocks \(backbone\.layers\): no matrices map the width 32")])
def test_an_mlp_with_a_part_ffnquant_does_not_compute_is_refused_naming_it(tmp_path, model_type, part):
    """RWKV's feed-forward mixes the previous token: the refusal names what it found, the cause, rather than only a
    failed run, no match, "no matrices map the width", or a convolution called an expert."""
    T = pytest.importorskip("transformers")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_models import save_causal_tiny, tokenizer

    try:
        folder = save_causal_tiny(T, model_type, tmp_path / "m", tokenizer(T))
    except Exception as exc:  # a transformers without the type
        pytest.skip(f"{model_type} not buildable here: {exc}")
    with pytest.raises(FFNQuantError, match=part):
        inspect_model(folder)


def test_an_ffn_of_another_form_than_the_main_one_is_named_float_with_what_differs(tmp_path):
    """NemotronH: routed experts in some blocks (the main FFN, most parameters), a dense ReLU² MLP in another of the
    same width: the MLP stays float, said as what it is (a dense MLP, not routed experts), not as another shape."""
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    from hf_models import save_causal_tiny, tokenizer

    T.logging.set_verbosity_error()
    info = inspect_model(save_causal_tiny(T, "nemotron_h", tmp_path / "m", tokenizer(T)))
    part = next(p for p in info.arch.float_parts if p.startswith("L3 "))
    assert "a dense MLP, not routed experts" in part and "main FFN is mixer.experts" in part
    assert "another shape" not in part and "\n" not in part


@pytest.mark.parametrize("model_type", ["mllama", "emu3"])
def test_a_text_model_saved_by_its_own_class_is_built_by_the_class_its_config_names(tmp_path, model_type):
    """Mllama's and Emu3's causal LMs save config.json with a model_type (mllama_text_model) that
    AutoModelForCausalLM does not map: the class config.json's `architectures` names builds it, for discovery
    and for the engine, and the embedding's extra rows (Mllama's image tokens) are checked against the model that
    class builds, not against vocab_size."""
    from ffnquant.hf.capture import load_hf_model
    from ffnquant.hf.skeleton import causal_lm_class
    from hf_models import tiny_or_skip

    folder = tiny_or_skip(model_type, tmp_path / "m")
    T = pytest.importorskip("transformers")
    config = T.AutoConfig.from_pretrained(folder)
    assert type(config) not in T.AutoModelForCausalLM._model_mapping
    assert causal_lm_class(T, config).__name__ == config.architectures[0]
    assert causal_lm_class(T, T.LlamaConfig()) is T.AutoModelForCausalLM
    info = inspect_model(folder)
    assert len(info.layers) == 2
    model = load_hf_model(info)
    assert type(model).__name__ == config.architectures[0]
