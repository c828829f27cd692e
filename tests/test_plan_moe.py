"""planning.moe: a layer of routed experts planned as one unit, through the engine.

The layer's output is computed from what its experts module receives (`Routed`) in the model's own arithmetic,
so ffnquant's float experts reproduce the module exactly and a candidate's error is the layer's. A plan of a
mixture-of-experts model meets its target, and `quantize --plan` measures the very figures the plan verified.
"""

from __future__ import annotations

import json

import pytest
import torch

from ffnquant.cli import main
from hf_models import save_causal_tiny, tokenizer

pytestmark = pytest.mark.hf

TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    T.logging.set_verbosity_error()
    root, tok = tmp_path_factory.mktemp("moe"), tokenizer(T)
    # 128 positions: the held-out text's 128 tokens are one window of every command
    return {t: save_causal_tiny(T, t, root / t, tok, max_position_embeddings=128) for t in ("qwen2_moe", "deepseek_v3")}


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v3"])
def test_the_routed_sum_of_the_float_experts_is_the_experts_module(moe, model_type):
    """What the experts module receives, summed over each token's experts by ffnquant's float FFNs, is the module's
    output: the plan scores candidates on the layer the model computes (deepseek_v3: a dense first layer stays
    float, outside the plan)."""
    from ffnquant.hf import inspect_model, load_ffn_layers
    from ffnquant.hf.capture import _module_for, load_hf_model
    from ffnquant.planning.moe import MoELayer, Routed

    info = inspect_model(moe[model_type])
    model = load_hf_model(info)
    names = [n for n, _ in model.named_modules()]
    seen = {}

    def keep(index):
        def hook(module, args, out):  # returns None: the output passes unchanged
            seen[index] = (Routed(args[0].reshape(-1, args[0].shape[-1]), args[1], args[2]), out.detach())
        return hook

    layers = load_ffn_layers(info)
    indices = sorted({layer.index for layer in layers})
    handles = [_module_for(model, info, next(l.info for l in layers if l.index == i), names)[1]
               .register_forward_hook(keep(i)) for i in indices]
    try:
        with torch.no_grad():
            model(torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0)))
    finally:
        for h in handles:
            h.remove()
    for i in indices:
        routed, want = seen[i]
        layer = MoELayer([l for l in layers if l.index == i])
        with torch.no_grad():
            got = layer.ffn(routed).reshape(want.shape)
        assert float((got - want).abs().max()) <= 1e-6 * float(want.abs().max()), i  # float32 summation order
        assert len(routed[:5]) == 5 and routed[:5].shape == (5, info.spec.d_model)


def test_an_moe_plan_is_what_quantize_measures(moe, tmp_path, capsys):
    """Each decoder layer of routed experts gets one recipe; the plan's verification and `quantize --plan` on the
    same texts agree to the last digit, since both run the same engine on the same experts."""
    folder = moe["qwen2_moe"]
    assert main(["plan", "--model", str(folder), "--target", "ppl+5%", "--candidates", "fp32,w8a8-dynamic-s8,w4a16-g32",
                 "--out", str(tmp_path / "p"), *TOKENS, "--eval-text", "prose", "--probe-tokens", "128",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "p" / "plan.json").read_text())
    # the whole-model graph holds the experts as QMoE nodes (weight-only): only a per-token int8 layer is refused
    dynamic = [r["recipe"] for r in data["plan"]["layers"] if r["recipe"] == "w8a8-dynamic-s8"]
    assert ("export --format onnx will refuse this model" in printed) == bool(dynamic)
    assert not dynamic or "QMoE computes on float activations" in printed
    assert data["verified"] and data["objective"] == "weight bytes"
    assert all(row["recipe"] != "fp32" for row in data["plan"]["layers"])  # 5% is room for quantizing something
    final = next(r for r in data["rounds"] if r["round"] == data["final_round"])
    assert main(["quantize", "--model", str(folder), "--plan", str(tmp_path / "p" / "plan.toml"), *TOKENS,
                 "--eval-text", "prose", "--no-progress", "--no-onnx", "--out-reports", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    report = json.loads(next((tmp_path / "q").glob("*.json")).read_text())
    (label, verified), = final["domains"].items()
    assert report["end_to_end"]["end_to_end"]["perplexity"] == verified["perplexity"]
    from ffnquant.hf import inspect_model

    experts = inspect_model(folder).layers  # every expert of every layer, each under its layer's recipe
    assert [(r["label"], r["recipe"]) for r in report["layers"]] == \
        [(e.label, data["plan"]["layers"][e.index]["recipe"]) for e in experts]


def test_a_latency_plan_of_routed_experts_is_refused_in_one_line(moe, tmp_path, capsys):
    assert main(["plan", "--model", str(moe["qwen2_moe"]), "--objective", "latency", "--out", str(tmp_path / "p"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "use --objective bytes" in err and not (tmp_path / "p").exists()
