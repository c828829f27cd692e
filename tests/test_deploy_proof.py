"""deploy.proof: an export's fold checked on the float model before anything is written, and the deployed model's
end-to-end figures gated against a reference of the ORIGINAL model, so the proof cannot share the exporter's mistake."""

from __future__ import annotations

import json

import pytest
import torch

from ffnquant.cli import main
from ffnquant.deploy import proof
from ffnquant.planning.planfile import Plan, model_fingerprint
from ffnquant.recipe import Recipe

from hf_models import tiny_folders

_TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128"]
SMOOTHED = {0: "w8a8@search+smooth", 1: "w8a8-s8+smooth"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_folders(tmp_path_factory, ("llama",))["llama"][0]


def _plan(llama, tmp_path, recipes):
    from ffnquant.hf import inspect_model

    path = tmp_path / "plan.toml"
    path.write_text(Plan(model_fingerprint(inspect_model(llama)), {i: Recipe.parse(r) for i, r in recipes.items()},
                         "ppl+1%", "latency").to_toml())
    return path


def _export(llama, plan, out, fmt="compressed-tensors"):
    return main(["export", "--model", str(llama), "--plan", str(plan), "--format", fmt, "--out", str(out), *_TOKENS])


@pytest.fixture
def wrong_norm(monkeypatch):
    """The export's fold puts each scale into the block's input_layernorm (the attention's input) instead of the
    post_attention_layernorm the MLP reads: the mistake of a norm_pattern naming the wrong norm."""
    import ffnquant.hf.fold as fold

    real = fold.fold_input_scales

    def fold_into_the_wrong_norm(model, info, ffns):
        before = {n: p.detach().clone() for n, p in model.named_parameters() if "post_attention_layernorm" in n}
        out = real(model, info, ffns)
        with torch.no_grad():
            for name, old in before.items():
                scaled = model.get_parameter(name)
                model.get_parameter(name.replace("post_attention_layernorm", "input_layernorm")).mul_(scaled / old)
                scaled.copy_(old)
        return out

    monkeypatch.setattr(fold, "fold_input_scales", fold_into_the_wrong_norm)


# --- the fold, checked before anything is written --------------------------------------------------------------

@pytest.mark.hf
@pytest.mark.parametrize("fmt", ["compressed-tensors", "onnx"])
def test_a_fold_into_the_wrong_norm_is_refused_and_nothing_is_written(llama, tmp_path, capsys, wrong_norm, fmt):
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    out = tmp_path / "out"
    assert _export(llama, _plan(llama, tmp_path, SMOOTHED), out, fmt) == 2
    err = capsys.readouterr().err.strip()
    assert _one_error_line(err)
    assert "the FFN input scales folded into the norms change the float model: logits " in err
    assert ("L0: scale folded into model.layers.0.input_layernorm, its FFN reads "
            "model.layers.0.post_attention_layernorm") in err
    assert "L1: scale folded into model.layers.1.input_layernorm" in err
    assert "float32 rounding allows 1.2e-04" in err and "plan these layers without +smooth and AWQ" in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".ffnquant")]


def test_a_layer_without_a_norm_of_its_own_is_named():
    check = proof.FoldCheck(folded=("L3",), norms={"L3": ("model.layers.3.attn_norm",)}, bound=1e-5, n_layers=4,
                            tokens=8, logits_max_rel=0.4, hidden_max_rel=0.3,
                            culprits=({"layer": "L3", "norm": ["model.layers.3.attn_norm"], "ffn_reads": None,
                                       "max_rel_diff": None},))

    class Info:
        class arch:
            name = "toy"

    text = proof.fold_refusal(check, Info)
    assert not check.exact and "\n" not in text
    assert "L3: scale folded into model.layers.3.attn_norm, its FFN reads no module's output" in text
    assert proof.fold_refusal(proof.FoldCheck(folded=(), norms={}, bound=1e-5, n_layers=4), Info) is None


def test_the_fold_bound_is_float32_rounding_over_depth():
    assert proof.fold_bound(2) == 2 * 2.0 ** 10 * 2.0 ** -24
    # SmolLM2-135M, 30 blocks: a correct fold measured 2.1e-6 there, one into the attention's norm 1.31
    assert 300 * 2.1e-6 < proof.fold_bound(30) < 1.31 / 700


def test_the_input_scale_is_read_back_exactly_from_the_records():
    from ffnquant import build
    from ffnquant.methods.fakequant import input_hessians, quantize_model
    from ffnquant.numerics.observe import profile
    from ffnquant.numerics.remedies import smooth
    from ffnquant.spec import FFNSpec, Variant

    model = build(FFNSpec(Variant.SWIGLU, 32, 64), seed=0)
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 8, 32)
    smoothed, record = smooth(model, profile(model, [x], weights=False), 0.5, sites=("input",))
    table = profile(smoothed, [x], weights=False)
    for scheme in ("w8a8", "w4a16-g32-awq"):  # SmoothQuant alone; then AWQ composed on top of it
        q = quantize_model(smoothed, scheme, table, remedies=[record], hessians=input_hessians(smoothed, [x]))
        assert torch.equal(proof.input_scale(q), q.model.input_transform.scale)
    assert proof.input_scale(quantize_model(model, "w8a16")) is None


# --- a correct plan still proves; the gates see what the fold check sees ---------------------------------------

@pytest.mark.hf
def test_a_correct_smoothed_plan_proves_with_every_gate_shown(llama, tmp_path, capsys):
    pytest.importorskip("compressed_tensors")
    out = tmp_path / "out"
    assert _export(llama, _plan(llama, tmp_path, SMOOTHED), out) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    fold = doc["fold"]
    assert fold["exact"] and fold["folded"] == ["L0", "L1"]
    assert fold["norms"] == {f"L{i}": [f"model.layers.{i}.post_attention_layernorm"] for i in (0, 1)}
    assert 0 < fold["logits_max_rel"] <= fold["bound"] / 10 and fold["hidden_max_rel"] <= fold["bound"] / 10
    load = doc["proof"]["load"]
    assert doc["proof"]["proven"] and load["gates"]["met"]
    assert [g["figure"] for g in load["gates"]["gates"]] == ["perplexity_ratio", "hidden_sqnr_db", "kl_mean"]
    allowance = load["allowance"]
    # measured on the original, unfolded model: its plain run is ffnquant's recorded reference again
    assert allowance["reproduces_reference"] and allowance["convention"] is None
    assert allowance["reference"]["hidden_sqnr_db"] == pytest.approx(doc["reference"]["hidden_sqnr_db"], rel=1e-9)
    if allowance["spread_measured"]:
        assert [r["input_scale"] for r in allowance["runs"]] == [1.0, 1.0 + 2.0 ** -23, 1.0 - 2.0 ** -23]
    else:  # the deployed figures met every gate against the reference itself: a spread would change no verdict
        assert [r["input_scale"] for r in allowance["runs"]] == [1.0]
        assert all(g["rounding_spread"] == 0.0 and g["worse_by"] <= g["allowed"] for g in load["gates"]["gates"])
    assert "fold: input scales of 2 layers folded into their norms" in printed and ": exact" in printed
    assert "final hidden SQNR" in printed and "KL mean" in printed
    md = (out / "ffnquant-deploy.md").read_text()
    assert "## The fold, checked on the float model" in md and "| final hidden SQNR |" in md and "| KL mean |" in md


@pytest.mark.hf
def test_without_the_fold_check_the_gates_still_refuse_the_wrong_fold(llama, tmp_path, capsys, wrong_norm,
                                                                       monkeypatch):
    """The measured failure: a wrong fold in the folder AND in ffnquant's folded model. Weights, input ranges and
    layer parity all hold (the folder is what ffnquant folded); only a reference of the original model sees it."""
    pytest.importorskip("compressed_tensors")
    monkeypatch.setattr(proof, "fold_refusal", lambda check, info: None)
    out = tmp_path / "out"
    assert _export(llama, _plan(llama, tmp_path, SMOOTHED), out) == 1
    assert "NOT PROVEN" in capsys.readouterr().out
    assert not out.exists()  # set aside: the evidence under a name that says so
    p = json.loads((out.with_name("out.not-proven") / "ffnquant-deploy.json").read_text())["proof"]
    assert p["weights"]["all_identical"] and p["inputs"]["all_equal"] and p["layers"]["all_at_parity"]
    gates = {g["figure"]: g for g in p["load"]["gates"]["gates"]}
    assert not gates["hidden_sqnr_db"]["met"] and gates["hidden_sqnr_db"]["worse_by"] > 10  # dB
    assert not gates["kl_mean"]["met"]


def test_the_gates_allow_twice_the_rounding_spread_and_no_more():
    allowance = {"reference": {"perplexity_ratio": 1.01, "hidden_sqnr_db": 30.0, "kl_mean": 0.010},
                 "spread": {"perplexity_ratio": 1e-5, "hidden_sqnr_db": 0.05, "kl_mean": 1e-4},
                 "reproduces_reference": True}

    def figures(ppl, db, kl):
        return {"perplexity_ratio": ppl, "hidden_sqnr_db": db, "kl": {"mean": kl}}

    ok = proof.end_to_end_gates(figures(1.0105, 29.91, 0.01019), allowance, 1e-3)
    assert ok["met"] and [g["met"] for g in ok["gates"]] == [True, True, True]
    assert proof.end_to_end_gates(figures(1.01, 35.0, 0.001), allowance, 1e-3)["met"]  # better is never refused
    worse = proof.end_to_end_gates(figures(1.01, 29.85, 0.0103), allowance, 1e-3)
    assert [g["met"] for g in worse["gates"]] == [True, False, False] and not worse["met"]
    assert not proof.end_to_end_gates(figures(1.0125, 30.0, 0.01), allowance, 1e-3)["met"]
    other = {**allowance, "reproduces_reference": False}
    assert not proof.end_to_end_gates(figures(1.01, 30.0, 0.01), other, 1e-3)["met"]


def _one_error_line(err: str) -> bool:
    """The error is one line, the last: the progress lines of the stages that ran before it stand above it."""
    lines = err.splitlines()
    return bool(lines) and sum("error" in line for line in lines) == 1 and "error" in lines[-1]


def test_an_unproven_folder_is_set_aside_under_a_free_name(tmp_path):
    """A folder whose proof failed is renamed to FOLDER.not-proven (then -2, -3, ...: an earlier one, or a user's
    file of that name, is never replaced), so nothing at the requested path looks like a deployment."""
    from ffnquant.wholemodel import set_aside_unproven

    (tmp_path / "out.not-proven").mkdir()
    (tmp_path / "out.not-proven" / "mine.txt").write_text("kept")
    for expected in ("out.not-proven-2", "out.not-proven-3"):
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "ffnquant-deploy.json").write_text("{}")
        assert set_aside_unproven(tmp_path / "out") == tmp_path / expected
        assert not (tmp_path / "out").exists() and (tmp_path / expected / "ffnquant-deploy.json").exists()
    assert (tmp_path / "out.not-proven" / "mine.txt").read_text() == "kept"


def test_transformers_generate_is_compared_as_plain_greedy_whatever_the_generation_config(tmp_path):
    """PLBart's generation_config forces EOS at the last step: transformers' generate() then ended every row with
    EOS, and the ONNX graph's greedy loop (and ffnquant's, and vLLM's) read as different. Compared under
    PLAIN_GREEDY, generate() is the argmax loop itself."""
    import transformers as T

    from ffnquant.deploy.proof import PLAIN_GREEDY
    from hf_models import save_causal_tiny

    T.logging.set_verbosity_error()
    model = T.AutoModelForCausalLM.from_pretrained(save_causal_tiny(T, "llama", tmp_path / "llama")).eval()
    assert all(hasattr(T.GenerationConfig(), key) for key in PLAIN_GREEDY)
    model.generation_config.forced_eos_token_id = 2
    model.generation_config.repetition_penalty = 5.0
    ids = torch.tensor([[5, 9, 11, 5]])
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1, max_new_tokens=6,
                             min_new_tokens=6, pad_token_id=0, **PLAIN_GREEDY)[0, 4:].tolist()
        want, seq = [], ids
        for _ in range(6):
            logits = model(seq).logits[0, -1]
            logits[model.generation_config.eos_token_id] = -float("inf")  # min_new_tokens holds EOS back
            token = int(logits.argmax())
            want.append(token)
            seq = torch.cat([seq, torch.tensor([[token]])], dim=1)
    assert got == want
