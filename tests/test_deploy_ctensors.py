"""export --format compressed-tensors: the folder transformers loads computes what the plan measured."""

from __future__ import annotations

import json

import pytest
import torch

from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.planning.planfile import Plan, model_fingerprint
from ffnquant.recipe import Recipe
from ffnquant.spec import FFNSpec, Variant

from hf_models import tiny_folders

ct = pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

from ffnquant.deploy import ctensors  # noqa: E402  (after the skip)

SPEC = FFNSpec(Variant.SWIGLU, 576, 1536)


# --- what the format can store -------------------------------------------------------------------

@pytest.mark.parametrize("recipe, why", [
    ("w8a8@search+rotate", "block-Hadamard at run time"),
    ("nf4", "bitsandbytes' code book"),
    ("w4a16-g64-hqq", "float zero points"),
    ("w4a16-g128", "group 128 does not divide d_model 576"),
    ("w4a16-g128-awq", "group 128 does not divide d_model 576"),
], ids=["rotate", "nf4", "hqq", "group-not-dividing", "asymmetric-group-not-dividing"])
def test_recipes_the_format_cannot_store_are_refused_in_one_line(recipe, why):
    text = ctensors.recipe_refusal(Recipe.parse(recipe), SPEC)
    assert text.startswith(f"recipe {recipe} cannot be written as compressed-tensors: ") and why in text
    assert "Supported: int8 weights" in text and "\n" not in text


@pytest.mark.parametrize("recipe", ["w8a8@search+smooth", "w8a8-s8", "w8a8-dynamic-s8", "w8a16", "w4a16-g64",
                                    "w4a16-g32-gptq", "w4a16-g64-asym", "w4a16-g64-awq", "fp8-e4m3", "fp8-e4m3-dynamic",
                                    "w8a8+float=hidden", "fp32"])
def test_recipes_the_format_stores(recipe):
    assert ctensors.recipe_refusal(Recipe.parse(recipe), SPEC) is None


def _module(recipe: str, weight: str = "w_down"):
    """A ModuleQuant of a small quantized FFN under `recipe`."""
    import torch

    from ffnquant import build
    from ffnquant.deploy.planned import _module_quants
    from ffnquant.methods.fakequant import quantize_model
    from ffnquant.numerics.observe import profile

    model = build(FFNSpec(Variant.SWIGLU, 32, 64), seed=0)
    r = Recipe.parse(recipe)
    table = profile(model, [torch.randn(64, 32, generator=torch.Generator().manual_seed(1))], weights=False)
    q = quantize_model(model, r.scheme, table, r.calibrator)
    names = {w: f"m.{w}" for w in ("w_up", "w_gate", "w_down")}
    return next(m for m in _module_quants("L0", 0, r, q, names) if m.weight == weight)


@pytest.mark.parametrize("recipe, weights, inputs", [
    ("w8a8", {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
     {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "tensor", "dynamic": False}),
    ("w8a8-s8", {"num_bits": 8, "strategy": "channel"}, {"symmetric": True, "strategy": "tensor", "dynamic": False}),
    ("w8a8-dynamic-s8", {"num_bits": 8}, {"symmetric": True, "strategy": "token", "dynamic": True}),
    ("w4a16-g32", {"num_bits": 4, "symmetric": True, "strategy": "group", "group_size": 32}, None),
    ("fp8-e4m3", {"num_bits": 8, "type": "float", "strategy": "tensor"},
     {"type": "float", "strategy": "tensor", "dynamic": False}),
], ids=["w8a8-uint8-static", "w8a8-int8-static", "dynamic-per-token", "w4-group", "fp8"])
def test_module_args_say_ffnquants_numerics_in_compressed_tensors_terms(recipe, weights, inputs):
    w, a = ctensors.module_args(_module(recipe))
    assert {k: w.model_dump(mode="json")[k] for k in weights} == weights
    if inputs is None:
        assert a is None
    else:
        assert {k: a.model_dump(mode="json")[k] for k in inputs} == inputs


# --- on a tiny Llama: written, loaded back, decompressed -------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_folders(tmp_path_factory, ("llama",))["llama"][0]


def _plan(llama, tmp_path, recipes: dict[int, str], name: str = "plan.toml"):
    from ffnquant.hf import inspect_model

    path = tmp_path / name
    path.write_text(Plan(model_fingerprint(inspect_model(llama)), {i: Recipe.parse(r) for i, r in recipes.items()},
                         "ppl+1%", "latency").to_toml())
    return path


_TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128"]

_PLANS = {
    "static-smooth-float-site+w4": {0: "w8a8@search+smooth+float=hidden", 1: "w4a16-g32"},
    "dynamic+w8a16": {0: "w8a8-dynamic-s8", 1: "w8a16"},
    "fp8+gptq": {0: "fp8-e4m3", 1: "w4a16-g32-gptq"},
}


@pytest.mark.hf
@pytest.mark.parametrize("recipes", list(_PLANS.values()), ids=list(_PLANS))
def test_the_folder_loads_with_transformers_and_is_the_measured_model(llama, tmp_path, recipes, capsys):
    import torch
    import transformers

    out = tmp_path / "llama-ffnq"
    assert main(["export", "--model", str(llama), "--plan", str(_plan(llama, tmp_path, recipes)),
                 "--format", "compressed-tensors", "--out", str(out), *_TOKENS]) == 0
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    # the plain thing first: the plan's target met or missed, on the terminal and above the proof in the report
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("the deployed model (loaded back) ") and "the plan's target (ppl+1%): " in first
    md = (out / "ffnquant-deploy.md").read_text()
    assert md.index("the plan's target (ppl+1%)") < md.index("Verdict:")
    load, weights = doc["proof"]["load"], doc["proof"]["weights"]
    # the bound: the loaded folder's perplexity equals the measured one within 0.1% relative
    assert load["meets"] and load["relative_difference"] <= 1e-3
    # perplexity, final hidden SQNR and KL each gated against a reference of the original (unfolded) model
    assert load["gates"]["met"] and len(load["gates"]["gates"]) == 3 and load["allowance"]["reproduces_reference"]
    # symmetric per-token int8 runs under compressed-tensors' absmax / 127.5: the reference is computed that way
    assert (load["gates"]["convention"] is not None) == ("w8a8-dynamic-s8" in recipes.values())
    # the generation check's reference takes the same convention, and with nothing folded it is the folder's
    # computation: greedy tokens equal on every prompt
    generation = doc["proof"]["generation"]
    assert generation["convention"] == load["gates"]["convention"] and generation["prompts"] == 4
    if not any("+smooth" in r for r in recipes.values()):
        assert generation["all_equal"], generation["rows"]
    smoothed = [f"L{i}" for i, r in sorted(recipes.items()) if "+smooth" in r]
    assert doc["fold"]["folded"] == smoothed and doc["fold"]["exact"]
    assert weights["all_identical"] and weights["modules"] == 6
    config = json.loads((out / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and "lm_head" in qc["ignore"]
    assert all(".self_attn." in n or n == "lm_head" or ".mlp." in n for n in qc["ignore"])
    assert (out / "tokenizer.json").is_file() and (out / "ffnquant-deploy.md").is_file()
    # what a user does: from_pretrained, nothing else
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 5, 7, 9]])).logits).all()


@pytest.mark.hf
def test_a_float_site_is_in_ignore_and_stored_as_it_was(llama, tmp_path):
    out = tmp_path / "o"
    plan = _plan(llama, tmp_path, _PLANS["static-smooth-float-site+w4"])
    assert main(["export", "--model", str(llama), "--plan", str(plan), "--format", "compressed-tensors",
                 "--out", str(out), *_TOKENS]) == 0
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.down_proj" in qc["ignore"]
    stored = ctensors.decompressed_weights(out)
    assert "model.layers.0.mlp.down_proj" not in stored and "model.layers.1.mlp.down_proj" in stored


@pytest.mark.hf
@pytest.mark.parametrize("edit, message", [
    (lambda a: a.__setitem__(a.index("--format") + 1, "gguf"), "unknown format 'gguf'; valid: onnx, compressed-tensors"),
    ("foreign", "plan"),
    ("rotate", "cannot be written as compressed-tensors"),
    ("not-empty", "exists and is not empty"),
], ids=["unknown-format", "foreign-plan", "rotate", "not-empty"])
def test_bad_input_is_one_line_exit_2_and_nothing_written(llama, tmp_path, capsys, edit, message):
    out = tmp_path / "out"
    plan = _plan(llama, tmp_path, _PLANS["dynamic+w8a16"])
    if edit == "foreign":
        data = plan.read_text().replace("n_layers = 2", "n_layers = 3")
        plan.write_text(data)
    if edit == "rotate":
        plan = _plan(llama, tmp_path, {0: "w8a8@search+rotate", 1: "w8a16"}, "rot.toml")
    if edit == "not-empty":
        out.mkdir()
        (out / "mine.txt").write_text("keep")
    argv = ["export", "--model", str(llama), "--plan", str(plan), "--format", "compressed-tensors", "--out", str(out),
            *_TOKENS]
    if callable(edit):
        edit(argv)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and _one_error_line(err)
    if edit == "not-empty":
        assert [p.name for p in out.iterdir()] == ["mine.txt"]
    else:
        assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ffnquant")) == []


@pytest.mark.hf
def test_asymmetric_4bit_groups_are_written_as_blocks_that_transformers_loads(llama, tmp_path):
    """AWQ and -asym: an asymmetric 4-bit grid stored as blocks of one row by a group (compressed-tensors' group
    layout packs the zero points, which transformers cannot load back): the library decompresses the folder to
    ffnquant's weight bit for bit, and transformers loads it with that weight."""
    import types

    import transformers

    from ffnquant.deploy.planned import ModuleQuant, PlannedModel
    from ffnquant.methods.fakequant import weight_grid
    from ffnquant.schemes import get_scheme

    scheme = get_scheme("w4a16-g32-asym")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32).eval()
    name = "model.layers.0.mlp.down_proj"
    linear = model.get_submodule(name)
    deq, grid = weight_grid(linear.weight, scheme)
    assert not grid.symmetric and bool((grid.zero_point != 0).any())  # really asymmetric: zero points stored
    with torch.no_grad():
        linear.weight.copy_(deq)
    mq = ModuleQuant(module=name, layer="L0", index=0, weight="w_down", site="hidden", recipe="w4a16-g32-asym",
                     scheme=scheme, grid=grid, input_mode=None, input_range=None)
    planned = PlannedModel(info=types.SimpleNamespace(path=str(llama), weights_format="pickle"), plan=None,
                           model=model, float_model=model, modules=[mq], evals=[], reference={})
    out = tmp_path / "asym"
    out.mkdir()
    ctensors.write_folder(planned, out)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    (group,) = config["config_groups"].values()
    assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [1, 32]
    from ffnquant.deploy.ctfiles import safetensors_reader

    zero_point = safetensors_reader(out)[1](name + ".weight_zero_point")
    assert tuple(zero_point.shape) == tuple(grid.scale.shape)  # unpacked: [out, groups]
    # compressed-tensors' q = round(w / s) + z, (q - z) * s is ffnquant's signed grid: the same codes, bit for bit
    assert torch.equal(ctensors.decompressed_weights(out)[name], deq)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the loaded model runs ffnquant's weight: the logits of the model that holds it
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.hf
def test_format_candidates_leave_out_what_the_format_refuses_with_its_reason(llama):
    from ffnquant.hf import inspect_model
    from ffnquant.planning.candidates import candidate_recipes, format_candidates

    info = inspect_model(llama)
    recipes, skipped = candidate_recipes("fp32,w8a16,w8a8-dynamic-s8+rotate,w4a16-g32-awq,fp8-e4m3,w4a16-g32",
                                         info.spec)
    kept, left = format_candidates(recipes, skipped, info, "compressed-tensors")
    assert [str(r) for r in kept] == ["fp32", "w8a16", "w4a16-g32-awq", "fp8-e4m3", "w4a16-g32"]
    reasons = {s["recipe"]: s["reason"] for s in left}
    assert set(reasons) == {"w8a8-dynamic-s8+rotate"}
    assert reasons["w8a8-dynamic-s8+rotate"] == ctensors.recipe_refusal(Recipe.parse("w8a8-dynamic-s8+rotate"), info.spec)
    assert "block-Hadamard at run time" in reasons["w8a8-dynamic-s8+rotate"]
    # the ONNX graph writes +rotate and AWQ but has no fp8 kernel
    kept, left = format_candidates(recipes, [], info, "onnx")
    assert [s["recipe"] for s in left] == ["fp8-e4m3"] and "fp8 e4m3" in left[0]["reason"]
    with pytest.raises(FFNQuantError, match="unknown format 'gguf'; valid: onnx, compressed-tensors"):
        format_candidates(recipes, [], info, "gguf")


@pytest.mark.hf
def test_a_model_the_format_refuses_is_refused_whatever_the_candidates(tmp_path):
    """gpt2's Conv1D matrices: compressed-tensors refuses the model; ONNX writes per-layer artifacts, so there only
    the recipes without an artifact are left out."""
    import transformers

    from ffnquant.hf import inspect_model
    from ffnquant.planning.candidates import candidate_recipes, format_candidates

    from hf_models import save_causal_tiny

    info = inspect_model(save_causal_tiny(transformers, "gpt2", tmp_path / "gpt2"))
    recipes, _ = candidate_recipes("fp32,w8a16,w8a8-dynamic-s8", info.spec)
    with pytest.raises(FFNQuantError, match="format compressed-tensors: gpt2: its MLP weights are transformers' Conv1D"):
        format_candidates(recipes, [], info, "compressed-tensors")
    kept, left = format_candidates(recipes, [], info, "onnx")
    assert [str(r) for r in kept] == ["fp32", "w8a16"]
    assert "no per-layer ONNX artifact" in left[0]["reason"] and "Conv1D" in left[0]["reason"]


@pytest.mark.hf
def test_force_replaces_an_earlier_export_only_and_a_failure_leaves_it(llama, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.safetensors").write_text("stale")
    plan = _plan(llama, tmp_path, _PLANS["dynamic+w8a16"])
    argv = ["export", "--model", str(llama), "--plan", str(plan), "--format", "compressed-tensors", "--out", str(out),
            "--force", *_TOKENS]
    # a file no earlier export listed: --force refuses in one line naming it, and deletes nothing
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "old.safetensors" in err and _one_error_line(err)
    assert [p.name for p in out.iterdir()] == ["old.safetensors"]
    (out / "old.safetensors").unlink()
    assert main(argv) == 0
    first = json.loads((out / "ffnquant-deploy.json").read_text())
    assert sorted(first["files"]) == sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())

    def broken(*a, **k):
        raise OSError(28, "No space left on device")

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(ctensors, "write_folder", broken)
    assert main(argv) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    monkeypatch.undo()
    assert main(argv) == 0  # an earlier export's folder is replaced
    assert (out / "config.json").is_file()


@pytest.mark.hf
def test_a_read_only_destination_is_one_line(llama, tmp_path, monkeypatch, capsys):
    import ffnquant.infra.atomic as atomic

    monkeypatch.setattr(atomic.os, "access", lambda path, mode: False)
    plan = _plan(llama, tmp_path, _PLANS["dynamic+w8a16"])
    assert main(["export", "--model", str(llama), "--plan", str(plan), "--format", "compressed-tensors",
                 "--out", str(tmp_path / "out"), *_TOKENS]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not writable" in err and _one_error_line(err)
    assert not (tmp_path / "out").exists()


def _one_error_line(err: str) -> bool:
    """The error is one line, the last: the progress lines of the stages that ran before it stand above it."""
    lines = err.splitlines()
    return bool(lines) and sum("error" in line for line in lines) == 1 and "error" in lines[-1]


# --- plan --format: a plan made for this format never ends in a refused export ------------------------------

_PLAN_SMALL = ["--calib-tokens", "256", "--eval-tokens", "128", "--probe-tokens", "128", "--no-progress",
               "--objective", "bytes", "--target", "ppl+5%"]


@pytest.mark.hf
def test_plan_for_compressed_tensors_leaves_out_what_it_refuses_and_exports(llama, tmp_path, capsys):
    out = tmp_path / "plan"
    rotate = "w8a8-dynamic-s8+rotate"
    assert main(["plan", "--model", str(llama), "--candidates", f"fp32,w8a16,{rotate}", "--format",
                 "compressed-tensors", "--out", str(out), *_PLAN_SMALL]) == 0
    printed = capsys.readouterr().out
    assert f"left out for --format compressed-tensors: {rotate} " in printed
    data = json.loads((out / "plan.json").read_text())
    assert data["export_format"] == "compressed-tensors" and data["candidates"] == ["fp32", "w8a16"]
    from ffnquant.hf import inspect_model

    why = ctensors.recipe_refusal(Recipe.parse(rotate), inspect_model(llama).spec)
    assert data["skipped_candidates"] == [{"recipe": rotate, "reason": why}] and "block-Hadamard" in why
    assert all(rotate not in {r["recipe"] for r in layer["candidates"]} for layer in data["layers"].values())
    assert f"{rotate} ({why})" in (out / "plan.md").read_text()
    assert data["deployment"]["compressed-tensors"] == ""
    # and the export of that plan is not refused
    folder = tmp_path / "folder"
    assert main(["export", "--model", str(llama), "--plan", str(out / "plan.toml"), "--format", "compressed-tensors",
                 "--out", str(folder), *_TOKENS]) == 0
    assert json.loads((folder / "ffnquant-deploy.json").read_text())["proof"]["weights"]["all_identical"]


@pytest.mark.hf
def test_plan_with_an_unknown_format_is_one_line_exit_2(llama, tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", "--model", str(llama), "--format", "gguf", "--out", str(out), *_PLAN_SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "ffnquant plan: error: unknown format 'gguf'; valid: onnx, compressed-tensors"
    assert not out.exists()


@pytest.fixture(scope="module")
def llama_bf16(llama, tmp_path_factory):
    """The tiny llama as a bf16 checkpoint, as SmolLM2, Llama, Qwen and Gemma ship."""
    T = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("bf16") / "llama-bf16"
    T.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).save_pretrained(folder)
    T.AutoTokenizer.from_pretrained(llama).save_pretrained(folder)
    return folder


@pytest.mark.hf
@pytest.mark.parametrize("recipes", [{0: "w8a16", 1: "fp32"}, {0: "w8a8@search+smooth", 1: "w4a16-g32"}],
                         ids=["one-layer-quantized", "smoothed-norm"])
def test_a_bf16_checkpoint_computed_in_float32_keeps_its_float_parts_in_bf16(llama_bf16, tmp_path, recipes, capsys):
    """With --compute-dtype float32, the float parts are stored in the source's bf16 where that is lossless (their
    values came from it), so a plan that quantizes one layer gives a folder smaller than the source; a norm that
    took a smoothing scale is not a bf16 value and stays float32, listed. The proof loads the folder in float32."""
    from safetensors import safe_open

    from ffnquant.deploy.ctensors import folder_bytes

    plan = _plan(llama_bf16, tmp_path, recipes)
    assert main(["export", "--model", str(llama_bf16), "--plan", str(plan), "--format", "compressed-tensors",
                 *_TOKENS, "--compute-dtype", "float32", "--out", str(tmp_path / "ct"), "--no-progress"]) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["proven"] and doc["proof"]["weights"]["all_identical"]
    assert doc["proof"]["load"]["compute_dtype"] == "float32"
    written = doc["written"]["float_dtype"]
    assert written["source"] == "bfloat16" and written["compute"] == "float32" and written["converted"] > 0
    smoothed = any("smooth" in r for r in recipes.values())
    assert bool(written["kept_float32"]) == smoothed and not written["rounded"]
    assert all("norm" in name for name in written["kept_float32"])  # only the norms that took the scale
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as fh:
        dtypes = {k: str(fh.get_slice(k).get_dtype()) for k in fh.keys()}
    assert dtypes["model.embed_tokens.weight"] == "BF16" and dtypes["model.layers.1.self_attn.q_proj.weight"] == "BF16"
    assert folder_bytes(tmp_path / "ct") < folder_bytes(llama_bf16)


@pytest.mark.hf
@pytest.mark.parametrize("recipes", [
    {0: "w8a8@search+smooth+float=hidden", 1: "w4a16-g32"},
    {0: "w8a8-dynamic-s8", 1: "w8a16"},
    {0: "fp8-e4m3", 1: "w4a16-g32-gptq"},
    {0: "w4a16-g32-awq", 1: "fp32"},
], ids=["static-smooth+w4", "per-token+w8a16", "fp8+gptq", "awq-asym+float"])
def test_a_bf16_checkpoint_is_computed_in_bf16_and_the_loaded_folder_is_that_computation(llama_bf16, tmp_path,
                                                                                         recipes, capsys):
    """By default a bf16 checkpoint's folder is what a bf16 runtime computes: the reference runs the model in
    bf16 with each quantized FFN's scales rounded to bf16 and compressed-tensors' own input quantizers, so the
    folder loaded by transformers in bf16 gives every FFN's output bit for bit on the same inputs; every tensor
    (scales included: they are bf16 values) is stored in bf16, a folded norm rounded as the runtime rounds it."""
    from safetensors import safe_open

    from ffnquant.deploy.ctensors import folder_bytes

    plan = _plan(llama_bf16, tmp_path, recipes)
    assert main(["export", "--model", str(llama_bf16), "--plan", str(plan), "--format", "compressed-tensors",
                 *_TOKENS, "--out", str(tmp_path / "ct"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())
    proof = doc["proof"]
    assert proof["proven"], out
    assert proof["load"]["compute_dtype"] == "bfloat16" and "(bfloat16)" in proof["load"]["loaded_with"]
    assert proof["weights"]["all_identical"]
    assert proof["layers"]["bit_identical"] == proof["layers"]["layers"] == 2  # the runtime's computation, exactly
    assert proof["load"]["allowance"]["step"] == 2.0 ** -7  # bf16's rounding step moves the allowance runs
    generation = proof["generation"]  # transformers' KV-cache generation of the folder against the reference
    assert generation["prompts"] == 4 and generation["with_cache"]
    if not any("smooth" in r or "awq" in r for r in recipes.values()):  # nothing folded: the same computation
        assert generation["all_equal"]
    written = doc["written"]["float_dtype"]
    assert (written["source"], written["stored"], written["compute"]) == ("bfloat16",) * 3
    assert not written["kept_float32"]
    assert all("norm" in name for name in written["rounded"])
    assert bool(written["rounded"]) == any("smooth" in r or "awq" in r for r in recipes.values())
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), "pt") as fh:
        dtypes = {k: str(fh.get_slice(k).get_dtype()) for k in fh.keys()}
    floats = {k: v for k, v in dtypes.items() if v in ("F32", "F16", "BF16", "F64")}
    assert floats and set(floats.values()) == {"BF16"}, floats
    assert any(k.endswith("weight_scale") for k in floats)
    assert folder_bytes(tmp_path / "ct") < folder_bytes(llama_bf16)
    assert "Computed in bfloat16" in (tmp_path / "ct" / "ffnquant-deploy.md").read_text()


@pytest.mark.hf
def test_an_onnx_export_computed_in_bf16_is_refused_in_one_line(llama_bf16, tmp_path, capsys):
    plan = _plan(llama_bf16, tmp_path, {0: "w8a16", 1: "fp32"})
    assert main(["export", "--model", str(llama_bf16), "--plan", str(plan), "--format", "onnx", "--compute-dtype",
                 "bf16", "--out", str(tmp_path / "o"), *_TOKENS]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("ffnquant export: error: compute dtype bfloat16: the onnx graph computes in float32; valid for "
                   "onnx: auto, float32")
    assert not (tmp_path / "o").exists()


@pytest.mark.hf
def test_a_plan_for_a_bf16_checkpoint_is_verified_in_bf16_and_its_export_measures_that(llama_bf16, tmp_path, capsys):
    """plan --format compressed-tensors on a bf16 checkpoint verifies its rounds in bf16, the runtime's dtype (the
    float figures too: the float model in bf16), and says so in plan.toml; exporting the plan computes the
    reference the same way, and the loaded folder reproduces it."""
    from ffnquant.planning import load_plan

    out = tmp_path / "plan"
    assert main(["plan", "--model", str(llama_bf16), "--candidates", "fp32,w8a16,w8a8-dynamic-s8", "--format",
                 "compressed-tensors", "--out", str(out), *_PLAN_SMALL]) == 0
    capsys.readouterr()
    data = json.loads((out / "plan.json").read_text())
    assert data["verified_in"] == "bfloat16" and "low_precision_baseline_s" in data["timings"]
    plan = load_plan(out / "plan.toml")
    assert plan.summary["verified_in"] == "bfloat16"
    assert main(["export", "--model", str(llama_bf16), "--plan", str(out / "plan.toml"), "--format",
                 "compressed-tensors", "--out", str(tmp_path / "ct"), *_TOKENS, "--no-progress"]) == 0
    doc = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["proven"] and doc["proof"]["load"]["compute_dtype"] == "bfloat16"


@pytest.mark.hf
def test_a_proof_without_one_generation_prompt_is_not_proven(llama, tmp_path, capsys):
    """A held-out text of a few tokens gives no generation prompt: 0 of 0 prompts equal is no evidence, so the
    folder is written but NOT PROVEN, saying why, and export exits 1."""
    short = tmp_path / "short.txt"
    short.write_text("Hello there friend")
    out = tmp_path / "llama-ffnq"
    rc = main(["export", "--model", str(llama), "--plan", str(_plan(llama, tmp_path, {0: "w8a16", 1: "w8a16"})),
               "--format", "compressed-tensors", "--out", str(out), "--calib-tokens", "256", "--eval-text", str(short)])
    printed = capsys.readouterr().out
    # nothing deployable-looking at --out: the folder is kept under a name that says it is not proven
    kept = tmp_path / "llama-ffnq.not-proven"
    assert not out.exists() and kept.is_dir() and f"the folder is kept as {kept}" in printed
    doc = json.loads((kept / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["generation"]["prompts"] == 0
    assert rc == 1 and not doc["proof"]["proven"]
    assert any("no generation prompt" in why for why in doc["proof"]["unproven"])
    assert "NOT PROVEN: no generation prompt: the held-out text has" in printed
    assert "Verdict: NOT PROVEN (no generation prompt" in (kept / "ffnquant-deploy.md").read_text()


@pytest.mark.hf
def test_transformers_failing_to_generate_with_the_model_class_is_said_not_a_crash(llama, monkeypatch):
    """BartForCausalLM's own `generate` fails in transformers (its cache holds no layers): the generation check says
    so and compares nothing, instead of an internal error; it was never a gate of the proof."""
    import transformers

    from ffnquant.deploy import build_planned_model
    from ffnquant.deploy.proof import generation_equality
    from ffnquant.hf import inspect_model

    info = inspect_model(llama)
    plan = Plan(model_fingerprint(info), {0: Recipe.parse("w8a16"), 1: Recipe.parse("w8a16")}, "ppl+1%", "bytes")
    planned = build_planned_model(info, plan, calib_tokens=256, eval_tokens=128)

    def broken(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(type(planned.float_model), "generate", broken)
    got = generation_equality(planned, transformers.AutoModelForCausalLM.from_pretrained(str(llama)))
    assert got["prompts"] == 0 and got["rows"] == []
    assert got["skipped"] == "transformers' generate fails on the original model: IndexError: list index out of range"


@pytest.mark.hf
def test_a_folder_transformers_cannot_load_is_not_proven_with_the_loaders_reason(llama, tmp_path, monkeypatch, capsys):
    """GPT-BigCode's model init reads .weight of a compressed Linear, so transformers cannot load its folder: the
    export says so as the reason, checks the files alone, exits 1 and keeps the folder aside, not a crash."""
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained

    def refuse(path, *args, **kwargs):  # the written folder only; the source model loads as usual
        if ".ffnquant-staging" in str(path):
            raise AttributeError("'Linear' object has no attribute 'weight'")
        return load(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    out = tmp_path / "llama-ffnq"
    rc = main(["export", "--model", str(llama), "--plan", str(_plan(llama, tmp_path, {0: "w8a16", 1: "w8a16"})),
               "--format", "compressed-tensors", "--out", str(out), *_TOKENS])
    printed = capsys.readouterr().out
    why = "transformers cannot load the folder: AttributeError: 'Linear' object has no attribute 'weight'"
    assert rc == 1 and not out.exists() and f"NOT PROVEN: {why}" in printed
    doc = json.loads((tmp_path / "llama-ffnq.not-proven" / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["unproven"] == [why] and doc["proof"]["weights"]["all_identical"]
    assert f"Verdict: NOT PROVEN ({why})" in (tmp_path / "llama-ffnq.not-proven" / "ffnquant-deploy.md").read_text()


@pytest.mark.parametrize("recipe, proven", [("w8a16", True), ("w8a8-dynamic-s8", False)],
                         ids=["weight-only-proven", "quantized-inputs-not-proven"])
def test_a_folder_whose_compressed_modules_transformers_cannot_run_is_loaded_decompressed(
        llama, tmp_path, monkeypatch, capsys, recipe, proven):
    """Where transformers cannot run a folder's compressed modules (GPT-BigCode's init, Zamba's tied shared block
    read `.weight` of a Linear compressed-tensors replaced), the proof loads it decompressed, as a transformers user
    must (`run_compressed=False`), and says so: every check as before for weight-only recipes; quantized inputs,
    which transformers drops when it decompresses, are not the plan: NOT PROVEN, with that reason."""
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained

    def compressed_refused(path, *args, **kwargs):
        if ".ffnquant-staging" in str(path) and "quantization_config" not in kwargs:
            raise AttributeError("'Linear' object has no attribute 'weight'")
        return load(path, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", compressed_refused)
    out = tmp_path / "llama-ffnq"
    rc = main(["export", "--model", str(llama), "--plan", str(_plan(llama, tmp_path, {0: recipe, 1: recipe})),
               "--format", "compressed-tensors", "--out", str(out), *_TOKENS])
    printed = capsys.readouterr().out
    if proven:
        assert rc == 0 and "loaded decompressed (CompressedTensorsConfig(run_compressed=False))" in printed
        proof = json.loads((out / "ffnquant-deploy.json").read_text())["proof"]
        assert proof["proven"] and proof["layers"]["all_at_parity"] and proof["load"]["gates"]["met"]
        assert proof["load"]["decompressed_because"] == "AttributeError: 'Linear' object has no attribute 'weight'"
        assert "loaded decompressed" in (out / "ffnquant-deploy.md").read_text()
    else:
        assert rc == 1 and not out.exists() and "drop the input quantization of L0, L1" in printed
        proof = json.loads((tmp_path / "llama-ffnq.not-proven" / "ffnquant-deploy.json").read_text())["proof"]
        assert not proof["proven"] and proof["weights"]["all_identical"]


@pytest.mark.parametrize("module, stored, want", [
    ("model.language_model.layers.0.mlp.gate_proj",
     {"language_model.model.layers.0.mlp.gate_proj", "vision_tower.encoder.layers.0.mlp.fc1"},
     "language_model.model.layers.0.mlp.gate_proj"),
    ("model.layers.0.mlp.up_proj", {"a.layers.0.mlp.up_proj", "b.layers.0.mlp.up_proj"}, "model.layers.0.mlp.up_proj"),
], ids=["multimodal-renamed", "ambiguous-kept"])
def test_a_module_is_read_under_the_one_stored_name_sharing_its_longest_tail(module, stored, want):
    """Gemma 3's files keep language_model.model.layers.N for the module model.language_model.layers.N: the one
    stored name with the longest shared tail; two such names leave the module's own (the bit-for-bit check decides)."""
    from ffnquant.deploy.ctfiles import stored_as as _stored_as

    assert _stored_as(module, stored) == want


def test_tensors_transformers_concatenates_at_load_are_written_concatenated_and_the_folder_is_proven(tmp_path):
    """OLMo hybrid's checkpoint keeps linear_attn.{q,k,v}_conv1d, which transformers concatenates into conv1d as it
    loads; with a quantization config present its loader found none of them ("Ckpt contains: 0") and every such
    folder ended NOT PROVEN. They are written concatenated under the loaded name, and the folder is proven."""
    from safetensors import safe_open

    from ffnquant.hf import inspect_model
    from hf_models import tiny_or_skip

    folder = tiny_or_skip("olmo_hybrid", tmp_path / "olmo_hybrid")
    info = inspect_model(folder)
    plan = tmp_path / "plan.toml"
    plan.write_text(Plan(model_fingerprint(info), {i: Recipe.parse("w4a16-g32") for i in range(info.n_layers)},
                         "ppl+1%", "bytes").to_toml())
    out = tmp_path / "ct"
    assert main(["export", "--model", str(folder), "--plan", str(plan), "--format", "compressed-tensors",
                 "--calib-tokens", "256", "--eval-tokens", "128", "--seq-len", "128", "--no-progress",
                 "--out", str(out)]) == 0
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["proven"]
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        keys = set(f.keys())
    assert any(k.endswith("linear_attn.conv1d.weight") for k in keys)
    assert not any(k.endswith("linear_attn.q_conv1d.weight") for k in keys)

