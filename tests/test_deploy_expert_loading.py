"""deploy.expert_loading: routed experts a model holds fused, written per expert and read back fused.

gpt-oss keeps its experts as gate_up_proj [E, d, 2f] (input-major, gate and up columns alternating) with biases:
the folder stores each expert as llm-compressor writes it (experts.N.{gate,up,down}_proj.weight_packed, ..., .bias),
transformers alone initialises those experts at random, and inside `per_expert_loading` its own loader decompresses
each one and writes it into the fused tensors, so the proof of today holds: bit-identical weights, layers at parity,
the loaded figures against the reference.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from ffnquant.cli import main
from hf_models import save_causal_tiny, tokenizer

pytestmark = pytest.mark.hf
pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128", "--seq-len", "128"]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    T.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("gpt_oss")
    folder = save_causal_tiny(T, "gpt_oss", root / "model", tokenizer(T))
    # biases the random init leaves at zero: set, so that a bias written to the wrong expert or half shows
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(0)
    for k in [k for k in tensors if k.endswith("_bias") and ".experts." in k]:
        tensors[k] = torch.randn(tensors[k].shape, generator=g) * 0.05
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def _fused_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


@pytest.mark.parametrize("bias", [False, True], ids=["weights", "biases"])
def test_splitting_then_fusing_gives_the_fused_tensor_back(gpt_oss, bias):
    """`split_tensor` (the writer) and `FuseExperts` (the loader's converter) are each other's inverse on gpt-oss'
    layout: interleaved gate and up columns, input-major, biases beside."""
    from ffnquant.deploy.expert_loading import FuseExperts, split_tensor
    from ffnquant.hf import inspect_model

    info = inspect_model(gpt_oss)
    model = _fused_model(gpt_oss)
    name = "model.layers.0.mlp.experts.gate_up_proj" + ("_bias" if bias else "")
    fused = model.get_parameter(name).detach()
    n = info.n_experts
    patterns = [f"model.layers.0.mlp.experts.*.{p}.{'bias' if bias else 'weight'}" for p in ("gate_proj", "up_proj")]
    parts = split_tensor(info.arch, "gate_up_proj", fused, n, patterns, bias=bias,
                         weight_shape=tuple(model.get_parameter("model.layers.0.mlp.experts.gate_up_proj").shape))
    assert len(parts) == 2 * n
    # gate is the even columns of the fused tensor, as gpt-oss' own forward reads it
    gate0 = parts[patterns[0].replace("*", "0")]
    assert torch.equal(gate0, fused[0, ..., 0::2] if bias else fused[0, :, 0::2].T)
    grouped = {p: [parts[p.replace("*", str(e))] for e in range(n)] for p in patterns}
    op = FuseExperts(info.arch, "gate_up_proj", "w_gate+w_up", n, bias=bias)
    back = op.convert(grouped, patterns, [name], model=model, full_layer_name=name)[name]
    assert torch.equal(back, fused)
    one_missing = {patterns[0]: grouped[patterns[0]]}
    with pytest.raises(Exception, match="it needs w_gate, w_up"):
        op.convert(one_missing, patterns, [name], model=model, full_layer_name=name)


def test_fused_experts_are_written_per_expert_and_proven(gpt_oss, tmp_path, capsys):
    """The folder holds llm-compressor's per-expert names (weights compressed, biases float), transformers alone
    loads it with those experts missing, and inside `per_expert_loading` the experts are ffnquant's dequantized
    weights and the model's own biases; the registration is gone afterwards."""
    import transformers
    from safetensors import safe_open

    from ffnquant.deploy import per_expert_loading
    from ffnquant.hf import inspect_model
    from hf_models import export_one_recipe

    info = inspect_model(gpt_oss)
    out = tmp_path / "ct"
    assert export_one_recipe(gpt_oss, "w4a16-g32", out) == 0
    said = capsys.readouterr().out
    assert "load the folder inside `with ffnquant.deploy.transformers_loading(folder):`" in said
    proof = json.loads((out / "ffnquant-deploy.json").read_text())["proof"]
    assert proof["proven"] and proof["weights"]["all_identical"] and proof["layers"]["all_at_parity"]
    assert proof["load"]["per_expert_loading"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert "transformers_loading(folder)" in (out / "ffnquant-deploy.md").read_text()
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        experts = sorted(k for k in f.keys() if ".experts." in k)
    pattern = re.compile(r"model\.layers\.[01]\.mlp\.experts\.\d\.(gate|up|down)_proj\."
                         r"(weight_packed|weight_scale|weight_shape|bias)")
    assert len(experts) == 2 * info.n_experts * 3 * 4 and all(pattern.fullmatch(k) for k in experts), experts[:5]

    with per_expert_loading(out) as modules:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert modules == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    original = _fused_model(gpt_oss)
    for name in ("gate_up_proj_bias", "down_proj_bias"):  # float, carried exactly
        assert torch.equal(loaded.get_parameter(f"model.layers.1.mlp.experts.{name}"),
                           original.get_parameter(f"model.layers.1.mlp.experts.{name}"))
    got = loaded.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
    want = original.get_parameter("model.layers.1.mlp.experts.gate_up_proj")
    # 4-bit groups of 32, symmetric: each weight within half a step (max|w| of its group / 7 / 2) of the original
    assert (got - want).abs().max() <= want.abs().max() / 7 / 2 + 1e-6
    _, alone = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                  output_loading_info=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in alone["missing_keys"]


def test_a_folder_left_fused_is_refused_in_one_line(gpt_oss, tmp_path, monkeypatch, capsys):
    """Without the per-expert tensors there is nothing for the compressed data to replace: refused in one line,
    no folder left."""
    import ffnquant.deploy.ctensors as ctensors
    from ffnquant.hf import inspect_model
    from ffnquant.planning.planfile import Plan, model_fingerprint
    from ffnquant.recipe import Recipe

    info = inspect_model(gpt_oss)
    plan = tmp_path / "plan.toml"
    plan.write_text(Plan(model_fingerprint(info), {i: Recipe.parse("w4a16-g32") for i in range(info.n_layers)},
                         "ppl+1%", "bytes").to_toml())
    monkeypatch.setattr(ctensors, "split_fused", lambda folder, model, info: [])
    assert main(["export", "--model", str(gpt_oss), "--plan", str(plan), "--format", "compressed-tensors", *TOKENS,
                 "--no-progress", "--out", str(tmp_path / "fused")]) == 2
    assert "transformers saved no tensor 'model.layers.0.mlp.experts.0." in capsys.readouterr().err
    assert not (tmp_path / "fused").exists()
