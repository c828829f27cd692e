"""deploy.experts: routed experts written to a compressed-tensors folder under their on-disk per-expert names.

A plan made for the format gives every routed expert one weight-only symmetric recipe (transformers' loader reads
the experts under one scheme, from `weight_packed`); the folder holds what llm-compressor writes for the same
model (`experts.N.<projection>.weight_packed`, `weight_scale`, `weight_shape`), loads in transformers, and its
proof is exact in both directions: the folder as written passes, and a folder whose experts are wrong fails.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ffnquant.cli import main
from ffnquant.planning.planfile import Plan, model_fingerprint
from ffnquant.recipe import Recipe
from hf_models import save_causal_tiny, tokenizer

pytestmark = pytest.mark.hf
pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128", "--seq-len", "128"]
# the on-disk name of each type's expert projections, as transformers saves them
PROJECTIONS = {"qwen3_moe": r"mlp\.experts\.\d+\.(gate|up|down)_proj", "mixtral": r"block_sparse_moe\.experts\.\d+\.w[123]"}


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    T.logging.set_verbosity_error()
    root, tok = tmp_path_factory.mktemp("experts"), tokenizer(T)
    return {t: save_causal_tiny(T, t, root / t, tok) for t in PROJECTIONS}


def _plan(folder, recipes, path):
    from ffnquant.hf import inspect_model

    info = inspect_model(folder)
    path.write_text(Plan(model_fingerprint(info), {i: Recipe.parse(r) for i, r in recipes.items()}, "ppl+1%",
                         "bytes").to_toml())
    return path


@pytest.mark.parametrize("recipe, why", [
    ("w8a8-dynamic-s8", "it quantizes activations"),
    ("w4a16-g32-asym", "asymmetric"),
    ("w4a16-g32-awq", "asymmetric"),
    ("fp8-e4m3", "quantizes activations"),
], ids=["activations", "asymmetric", "awq", "fp8"])
def test_recipes_routed_experts_cannot_take_are_refused_with_the_loaders_reason(recipe, why):
    from ffnquant.deploy.experts import EXPERTS_WHY, experts_refusal

    message = experts_refusal(Recipe.parse(recipe))
    assert why in message and EXPERTS_WHY in message and "\n" not in message


@pytest.mark.parametrize("recipe", ["fp32", "w4a16-g32", "w4a16-g32-gptq", "w8a16"])
def test_recipes_routed_experts_take(recipe):
    from ffnquant.deploy.experts import experts_refusal

    assert experts_refusal(Recipe.parse(recipe)) is None


def test_a_plan_giving_the_experts_two_recipes_is_refused_naming_them(moe, tmp_path, capsys):
    from ffnquant.deploy.experts import plan_experts_refusal
    from ffnquant.hf import inspect_model
    from ffnquant.planning.planfile import load_plan

    folder = moe["qwen3_moe"]
    path = _plan(folder, {0: "w4a16-g32", 1: "fp32"}, tmp_path / "mixed.toml")
    why = plan_experts_refusal(load_plan(path, inspect_model(folder)), inspect_model(folder))
    assert "2 recipes (L0 w4a16-g32, L1 fp32)" in why and "--format compressed-tensors" in why
    assert main(["export", "--model", str(folder), "--plan", str(path), "--format", "compressed-tensors", *TOKENS,
                 "--out", str(tmp_path / "ct")]) == 2
    assert "2 recipes (L0 w4a16-g32, L1 fp32)" in capsys.readouterr().err and not (tmp_path / "ct").exists()


@pytest.mark.parametrize("model_type", list(PROJECTIONS))
def test_a_plan_for_the_format_ties_the_experts_and_its_folder_is_llm_compressors_layout(moe, model_type, tmp_path,
                                                                                         capsys):
    """plan --format compressed-tensors: one recipe for every layer of routed experts; the export stores each
    expert's projections packed under their on-disk names (no float copy left), one `re:` config group naming the
    experts, and is proven: every expert's weight decompressed bit for bit, every expert's output in the loaded
    model equal to ffnquant's."""
    from safetensors import safe_open

    folder = moe[model_type]
    assert main(["plan", "--model", str(folder), "--format", "compressed-tensors", "--objective", "bytes",
                 "--target", "ppl+5%", "--candidates", "fp32,w8a8-dynamic-s8,w4a16-g32,w8a16", *TOKENS,
                 "--probe-tokens", "128", "--no-progress", "--out", str(tmp_path / "p")]) == 0
    plan = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert len({row["recipe"] for row in plan["plan"]["layers"]}) == 1
    assert any(s["recipe"] == "w8a8-dynamic-s8" and "quantizes activations" in s["reason"]
               for s in plan["skipped_candidates"])
    capsys.readouterr()
    tied = _plan(folder, {0: "w4a16-g32", 1: "w4a16-g32"}, tmp_path / "tied.toml")  # quantized, whatever was chosen
    out = tmp_path / "ct"
    assert main(["export", "--model", str(folder), "--plan", str(tied), "--format", "compressed-tensors", *TOKENS,
                 "--no-progress", "--out", str(out)]) == 0
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    proof = doc["proof"]
    assert proof["proven"] and proof["weights"]["all_identical"] and proof["weights"]["modules"] == 2 * 4 * 3
    assert proof["layers"]["layers"] == 8 and proof["layers"]["all_at_parity"]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    experts = [k for k in keys if ".experts." in k]
    pattern = re.compile(rf"model\.layers\.[01]\.{PROJECTIONS[model_type]}\.weight_(packed|scale|shape)")
    assert len(experts) == 2 * 4 * 3 * 3 and all(pattern.fullmatch(k) for k in experts), experts[:4]
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["routed_experts"]
    assert group["format"] == "pack-quantized" and group["weights"]["num_bits"] == 4
    assert group["targets"][0].startswith("re:") and "experts" in group["targets"][0]
    assert doc["written"]["routed_experts"]["quantized"] == 24


def test_the_proof_fails_a_folder_whose_experts_are_wrong(moe, tmp_path):
    """The proof is exact in both directions: the folder as written passes; one expert's codes changed, or one
    layer's experts missing (transformers initialises them at random), fail it, each saying why."""
    from safetensors.torch import load_file, save_file

    from ffnquant.deploy import build_planned_model, ctensors
    from ffnquant.hf import inspect_model

    folder = moe["qwen3_moe"]
    info = inspect_model(folder)
    plan = Plan(model_fingerprint(info), {0: Recipe.parse("w4a16-g32"), 1: Recipe.parse("w4a16-g32")}, "ppl+1%", "bytes")
    planned = build_planned_model(info, plan, calib_tokens=256, eval_tokens=128, seq_len=128)
    good = tmp_path / "good"
    good.mkdir()
    ctensors.write_folder(planned, good)
    assert ctensors.verify_folder(good, planned)["proven"]

    def planted(name, edit):
        bad = tmp_path / name
        bad.mkdir()
        for f in good.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        state = load_file(str(bad / "model.safetensors"))
        edit(state)
        save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
        return ctensors.verify_folder(bad, planned)

    def flip_codes(state):  # every code of one expert's gate moved by one step of its 4-bit grid
        key = "model.layers.1.mlp.experts.2.gate_proj.weight_packed"
        state[key] = state[key] ^ torch.full_like(state[key], 0x11111111)

    proof = planted("codes", flip_codes)
    assert not proof["proven"] and "weights differ" in proof["unproven"]
    wrong = [r["module"] for r in proof["weights"]["rows"] if not r["bit_identical"]]
    assert wrong == ["model.layers.1.mlp.experts.2.gate_proj"]

    def drop_layer(state):
        for key in [k for k in state if k.startswith("model.layers.0.mlp.experts.")]:
            del state[key]

    proof = planted("missing", drop_layer)
    assert not proof["proven"] and "weights differ" in proof["unproven"]
    assert {r["how"] for r in proof["weights"]["rows"] if not r["bit_identical"]} == {"missing from the files"}
    assert "layers not within rounding ties" in proof["unproven"]


def test_both_formats_take_routed_experts_and_a_plan_for_vllms_cpu_build_leaves_out_what_it_refuses(moe):
    from ffnquant.deploy.planned import deployable_refusal
    from ffnquant.hf import inspect_model
    from ffnquant.planning.candidates import candidate_recipes, serve_candidates

    info = inspect_model(moe["qwen3_moe"])
    # the whole-model ONNX graph holds them as onnxruntime MoE/QMoE nodes (tests/test_deploy_onnx_experts.py)
    assert deployable_refusal(info, "compressed-tensors") is None and deployable_refusal(info, "onnx") is None
    recipes, _ = candidate_recipes("fp32,w4a16-g32", info.spec)
    kept, left = serve_candidates(recipes, [], info, "vllm-cpu")
    assert [str(r) for r in kept] == ["fp32"]
    assert "No WNA16 MoE backend" in left[0]["reason"] and "kInt4Static32" in left[0]["reason"]


@pytest.mark.parametrize("recipe, amx, why", [
    ("w4a16-g64", True, None), ("w4a16-g128", True, None), ("fp32", False, None),
    ("w4a16-g64", False, "no AMX tiles"), ("w4a16-g32", True, "kInt4Static32"),
    ("w8a16", True, "4-bit symmetric weight-only groups"), ("w8a8-dynamic-s8", True, "4-bit symmetric weight-only"),
    ("w4a16-g64-gptoss", True, "SiLU-gated experts without biases"),
], ids=lambda v: str(v))
def test_vllms_cpu_build_serves_experts_as_measured(recipe, amx, why):
    """vLLM's CPU build serves 4-bit symmetric groups other than 32 of SiLU-gated experts on a CPU with AMX tiles
    (CPUExpertsInt4, measured by benchmarks/vllm_experts.py: reports/serve/moe-vllm); the rest with its reason."""
    from ffnquant.deploy.vllm import vllm_cpu_experts_refusal
    from ffnquant.recipe import Recipe
    from ffnquant.spec import Activation, FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, 128, 256)
    if recipe.endswith("-gptoss"):  # gpt-oss' experts: their own clamped gate, biases
        recipe, spec = recipe.removesuffix("-gptoss"), FFNSpec(Variant.SWIGLU, 128, 256, bias=True,
                                                              activation_override=Activation.OWN_GATE)
    got = vllm_cpu_experts_refusal(Recipe.parse(recipe), spec, amx=amx)
    assert got is None if why is None else (why in got and "No WNA16 MoE backend" in got and recipe in got), got


def test_experts_without_a_gate_are_written_and_proven(tmp_path):
    """NemotronH's experts have no gate (up_proj [E, f, d] through ReLU², down_proj [E, d, f]): each expert's two
    projections are written packed under their on-disk names and the folder is proven, expert by expert."""
    from safetensors import safe_open

    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    T.logging.set_verbosity_error()
    folder = save_causal_tiny(T, "nemotron_h", tmp_path / "nemotron_h", tokenizer(T))
    plan = _plan(folder, {1: "w4a16-g32"}, tmp_path / "plan.toml")  # L1 is the block of routed experts
    out = tmp_path / "ct"
    assert main(["export", "--model", str(folder), "--plan", str(plan), "--format", "compressed-tensors", *TOKENS,
                 "--no-progress", "--out", str(out)]) == 0
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["proven"] and doc["proof"]["weights"]["all_identical"] and doc["proof"]["weights"]["modules"] == 8
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        experts = [k for k in f.keys() if ".experts." in k]
    pattern = re.compile(r"backbone\.layers\.1\.mixer\.experts\.\d\.(up|down)_proj\.weight_(packed|scale|shape)")
    assert len(experts) == 4 * 2 * 3 and all(pattern.fullmatch(k) for k in experts), experts[:4]


def test_experts_transformers_saves_fused_are_written_per_expert_and_a_folder_left_fused_fails(tmp_path, monkeypatch,
                                                                                              capsys):
    """Llama 4 stores its routed experts fused and input-major (gate_up_proj [E, d, 2f], down_proj [E, f, d]) and
    transformers saves them so, but loads a compressed-tensors folder's experts per expert
    (SequentialLlama4TextExperts): each quantized expert is written packed under experts.N.<projection>, llm-
    compressor's layout, and the folder is proven expert by expert. Left fused, there is no per-expert tensor to
    replace: refused in one line, no folder left."""
    from safetensors import safe_open

    import ffnquant.deploy.ctensors as ctensors

    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    T.logging.set_verbosity_error()
    folder = save_causal_tiny(T, "llama4_text", tmp_path / "llama4", tokenizer(T))
    plan = _plan(folder, {0: "w4a16-g32", 1: "w4a16-g32"}, tmp_path / "plan.toml")  # its routed experts
    out = tmp_path / "ct"
    assert main(["export", "--model", str(folder), "--plan", str(plan), "--format", "compressed-tensors", *TOKENS,
                 "--no-progress", "--out", str(out)]) == 0
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    proof = doc["proof"]
    assert proof["proven"] and proof["missing_from_files"] == [] and proof["weights"]["all_identical"]
    assert proof["weights"]["modules"] == 2 * 4 * 3  # two layers of four experts, three projections each
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.feed_forward.experts.gate_up_proj" not in keys
    assert {f"model.layers.1.feed_forward.experts.3.{p}_proj.weight_{k}" for p in ("gate", "up", "down")
            for k in ("packed", "scale", "shape")} <= keys
    capsys.readouterr()
    monkeypatch.setattr(ctensors, "unfused_for_loader", lambda folder, model: [])
    assert main(["export", "--model", str(folder), "--plan", str(plan), "--format", "compressed-tensors", *TOKENS,
                 "--no-progress", "--out", str(tmp_path / "fused")]) == 2
    said = capsys.readouterr()
    assert "transformers saved no tensor 'model.layers.0.feed_forward.experts.0." in said.err
    assert not (tmp_path / "fused").exists()


def test_experts_saved_under_names_transformers_renames_are_written_under_them_and_proven(tmp_path):
    """DeepSeek-V4 saves its experts as layers.N.ffn.experts.M.w{1,2,3}, loaded as .mlp. (a WeightRenaming): the
    compressed tensors replace the float ones under the names the file keeps (an internal error read them under
    the loaded names), and transformers loads the folder as proven."""
    from safetensors import safe_open

    from ffnquant.hf import inspect_model
    from hf_models import tiny_or_skip

    folder = tiny_or_skip("deepseek_v4", tmp_path / "dsv4")
    info = inspect_model(folder)
    plan = _plan(folder, {i: "w4a16-g32" for i in range(info.n_layers)}, tmp_path / "plan.toml")
    out = tmp_path / "ct"
    assert main(["export", "--model", str(folder), "--plan", str(plan), "--format", "compressed-tensors", *TOKENS,
                 "--no-progress", "--out", str(out)]) == 0
    assert json.loads((out / "ffnquant-deploy.json").read_text())["proof"]["proven"]
    with safe_open(str(next(out.glob("*.safetensors"))), framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.ffn.experts.0.w1.weight_packed" in keys
    assert not any(k.startswith("model.layers.0.mlp.experts.") for k in keys)
    assert "model.layers.0.ffn.experts.0.w1.weight" not in keys
