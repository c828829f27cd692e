"""The architecture matrix: every causal-LM model type of `hf_models.CAUSAL_TYPES`, a tiny random-weight model
each, found from the model itself (`hf.discover`) and taken as far as ffnquant takes it.

Each type of the fast subset (`FULL_PATH`: the others' FFNs take a representative's path) runs `plan`, and either `export --format compressed-tensors` -> load with exact weights (the export's
proof), or is refused one named feature with its reason: smoothing where the input scale cannot fold (parallel
blocks, a residual-stream FFN input, a router reading the norm), compressed-tensors for Conv1D and FalconLinear
and for experts a checkpoint stores fused, the whole-model ONNX graph for routed experts (their layers plan, every
expert of a layer under one recipe; a plan for compressed-tensors gives all of them one, and its folder stores
each expert under its on-disk name, proven: `tests/test_deploy_experts.py`).
"""

from __future__ import annotations

import json

import pytest
import torch

from ffnquant.cli import main
from ffnquant.hf import inspect_model
from ffnquant.planning.planfile import Plan, model_fingerprint
from ffnquant.recipe import Recipe
from hf_models import CAUSAL_TYPES, VOCAB, save_causal_tiny, tokenizer

pytestmark = pytest.mark.hf
pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

# what discovery must find: (variant, install, transposed, experts)
EXPECTED = {
    "llama": ("swiglu", "module"), "mistral": ("swiglu", "module"), "qwen2": ("swiglu", "module"),
    "gemma": ("geglu", "module"), "phi3": ("swiglu", "module"), "gpt2": ("gelu_tanh", "module"),
    "opt": ("relu", "split"), "mixtral": ("swiglu", "experts"), "qwen3": ("swiglu", "module"),
    "gemma2": ("geglu", "module"), "gemma3_text": ("geglu", "module"), "olmo2": ("swiglu", "module"),
    "granite": ("swiglu", "module"), "cohere": ("swiglu", "module"), "stablelm": ("swiglu", "module"),
    "starcoder2": ("gelu_tanh", "module"), "gpt_neox": ("gelu", "module"), "falcon": ("gelu", "module"),
    "phi": ("gelu_tanh", "module"), "smollm3": ("swiglu", "module"), "glm": ("swiglu", "module"),
    "exaone4": ("swiglu", "module"), "qwen2_moe": ("swiglu", "experts"), "qwen3_moe": ("swiglu", "experts"),
    "deepseek_v3": ("swiglu", "experts"), "nemotron": ("relu", "module"), "arcee": ("relu", "module"),
    # BLOOM's and MPT's MLPs take the block's residual and add it (`Arch.residual_arg`)
    "bloom": ("gelu_tanh", "module"), "mpt": ("gelu", "module"),
    # hybrids of linear and full attention (Qwen3-Next with routed experts, Qwen3.5), gated queries (q_proj twice
    # as wide), and DeepSeek-V2's latent attention: the attention's layout is transformers' business
    "qwen3_next": ("swiglu", "experts"), "qwen3_5_text": ("swiglu", "module"), "deepseek_v2": ("swiglu", "experts"),
    # GraniteMoE's checkpoint stores its experts under names transformers renames as it loads
    "granitemoe": ("swiglu", "experts"),
    # an encoder class as a causal LM: its FFN's two Linears in two modules (intermediate.dense, output.dense, whose
    # module adds the residual and normalises), installed Linear by Linear; positions start past the padding id
    "roberta": ("gelu", "split"),
    # the model's own functions (`hf.own`), no named activation reproducing them: Apertus' xIELU with learned
    # parameters per layer (a dense FFN, activation own), BitNet's norm of the hidden (its MLP run with its Linears
    # replaced), MiniMax-M3's clamped SwiGLU of gate and up (its experts' own gate function)
    "apertus": ("relu", "module"), "bitnet": ("reglu", "module"), "minimax_m3_vl_text": ("reglu", "experts"),
    # experts held flat, [experts x f, d] each, gate and up output-major and down input-major, in a child module
    "dbrx": ("swiglu", "experts"),
    # a MoE that routes its tokens itself, its experts' matrices two child modules called with the rows sorted by
    # expert and their counts
    "jetmoe": ("swiglu", "experts"),
    # hidden states whose batch is not the first dimension: Gemma 3n's AltUp inputs [inputs, batch, tokens, width]
    # (its base model's last hidden state is not its hidden_states[-1]), XLNet's [tokens, batch, width]
    "gemma3n_text": ("geglu", "module"), "xlnet": ("gelu", "split"),
    # its list of blocks is its FFNs, its attentions and norms run between them by its forward (`hf.replay`)
    "xlm": ("gelu", "split"),
    # per-layer inputs from its embedding: the engine reads its tied head's weight again at the head's turn
    "gemma4_text": ("geglu", "module"),
    "zamba": ("geglu", "module"),  # one FFN every hybrid layer calls (its weights shared, stored once)
    # its main FFN split across two children of the block, kept over its language adapter (an MLP module)
    "xmod": ("gelu", "split"),
}
OWN = {"apertus": "own", "bitnet": "own_gate", "minimax_m3_vl_text": "own_gate"}
RESIDUAL_ARG = ("bloom", "mpt")
# why a smoothed layer's input scale cannot fold there, as the graph shows it
NO_FOLD = {"cohere": "also read by .*self_attn", "falcon": "also read by .*self_attention",
           "phi": "also read by .*self_attn", "olmo2": "no module produces the FFN's input",
           "exaone4": "no module produces the FFN's input", "roberta": r"also read by .*layer\.0\.output",
           "xmod": r"also read by .*layer\.0\.output",
           # post-LN: the residual reads the norm
           "xlnet": r"rel_attn\.layer_norm changes the model's output", "xlm": r"layer_norm1\.0 changes the model's output"}
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "qwen3_next", "deepseek_v2", "granitemoe",
       "minimax_m3_vl_text", "dbrx", "jetmoe")  # planned by bytes
# their checkpoints store the experts fused (3-D tensors, DBRX's flat 2-D ones): compressed-tensors refuses them
FUSED_EXPERTS = ("granitemoe", "minimax_m3_vl_text", "dbrx", "jetmoe")  # held fused on disk too
NO_CT = {"gpt2": "Conv1D", "falcon": "FalconLinear"}
# CI's fast subset of the plan -> export -> load path (the benchmark, benchmarks/architecture_matrix.py, takes every
# type through it): a type whose FFN is discovered as its representative's, with the same fold and format verdicts,
# goes through discovery and the engine here and leaves the whole path to its representative
SAME_PATH_AS = {"mistral": "llama", "qwen2": "llama", "qwen3": "llama", "smollm3": "llama", "granite": "llama",
                "stablelm": "llama", "arcee": "nemotron", "gemma2": "gemma", "gemma3_text": "gemma",
                "exaone4": "olmo2"}
FULL_PATH = tuple(t for t in CAUSAL_TYPES if t not in SAME_PATH_AS)
TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128"]
# plan and export read whole windows of the held-out text: 128 tokens (a model without a context length, ALiBi's
# BLOOM and MPT, would take 512-token windows, more than the 128 held-out tokens)
WINDOW = ["--seq-len", "128"]


def test_the_matrix_covers_the_named_types():
    assert set(EXPECTED) == set(CAUSAL_TYPES) and len(CAUSAL_TYPES) >= 25


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    T.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("matrix")
    tok = tokenizer(T)
    return {t: save_causal_tiny(T, t, root / t, tok) for t in CAUSAL_TYPES}


@pytest.mark.parametrize("model_type", CAUSAL_TYPES)
def test_discovered_ffns_reproduce_the_model(folders, model_type):
    """The FFNs found from the model: the expected shape, and ffnquant's FFN computes what the model's module does."""
    from ffnquant.hf import load_ffn_layers
    from ffnquant.hf.capture import _module_for, load_hf_model

    info = inspect_model(folders[model_type])
    variant, install = EXPECTED[model_type]
    assert (info.spec.variant.value, str(info.arch.install)) == (variant, install)
    assert info.spec.activation.value == OWN.get(model_type, info.spec.activation.value)
    assert (info.arch.activation_template is not None) == (model_type in OWN)
    assert info.arch.discovered and all(layer.index in info.arch.fixed["blocks"] for layer in info.layers)
    if info.n_experts:
        assert any("router stays float" in part for part in info.arch.float_parts)
    if install != "module":
        return  # experts and in-block Linears: checked end to end by quantize below
    model = load_hf_model(info)
    names = [n for n, _ in model.named_modules()]
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    assert info.arch.residual_arg is (model_type in RESIDUAL_ARG)

    def keep(label):
        def hook(module, args, out):  # returns None: the output passes unchanged
            ffn_out = out - args[1] if info.arch.residual_arg else out  # what the module adds is the residual
            seen.setdefault(label, (args[0].detach().clone(), ffn_out.detach().clone()))  # falcon adds in place
        return hook

    handles = [_module_for(model, info, layer, names)[1].register_forward_hook(keep(layer.label)) for layer in info.layers]
    try:
        with torch.no_grad():
            model(torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0)))
    finally:
        for h in handles:
            h.remove()
    for layer in load_ffn_layers(info):
        x, want = seen[layer.label]
        with torch.no_grad():
            got = layer.ffn(x.reshape(-1, x.shape[-1])).reshape(want.shape)
        # float32 summation order only (addmm vs matmul + add, gelu_new's formula vs torch's tanh GELU)
        assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max()), (model_type, layer.label)


def _plan(folder, recipes, path):
    info = inspect_model(folder)
    idx = sorted({layer.index for layer in info.layers if layer.shares is None})
    chosen = {i: Recipe.parse(recipes[k % len(recipes)]) for k, i in enumerate(idx)}
    # a layer calling an earlier layer's FFN (its weights shared) takes that layer's recipe
    chosen.update({layer.index: chosen[layer.shares] for layer in info.layers if layer.shares is not None})
    path.write_text(Plan(model_fingerprint(info), dict(sorted(chosen.items())), "ppl+1%", "latency").to_toml())
    return path


@pytest.mark.parametrize("model_type", sorted(SAME_PATH_AS))
def test_a_type_left_to_its_representative_takes_the_same_path(model_type):
    rep = SAME_PATH_AS[model_type]
    assert rep in FULL_PATH and EXPECTED[model_type] == EXPECTED[rep]
    for verdicts in (NO_FOLD, NO_CT, OWN, MOE, RESIDUAL_ARG):
        assert (model_type in verdicts) == (rep in verdicts)
    assert NO_FOLD.get(model_type) == NO_FOLD.get(rep)


@pytest.mark.parametrize("model_type", FULL_PATH)
def test_every_type_plans_exports_and_loads_or_names_what_it_refuses(folders, model_type, tmp_path, capsys):
    folder = folders[model_type]
    assert main(["quantize", "--model", str(folder), "--scheme", "w8a8", *TOKENS, "--no-progress",
                 "--out-reports", str(tmp_path / "q"), "--out-artifacts", str(tmp_path / "qa")]) == 0
    capsys.readouterr()
    # bytes: the latency table times one FFN shape, not an architecture (tests/test_plan_objective.py times it)
    assert main(["plan", "--model", str(folder), "--target", "ppl+5%", "--objective", "bytes",
                 "--candidates", "fp32,w8a8@search+smooth,w4a16-g32",
                 "--out", str(tmp_path / "p"), *TOKENS, *WINDOW, "--probe-tokens", "128", "--tokens", "16",
                 "--no-progress"]) == 0
    data = json.loads((tmp_path / "p" / "plan.json").read_text())
    if model_type in NO_FOLD:  # the plan knew: smoothing left out where it cannot fold
        assert data["fold_refusals"] and all(r["recipe"] != "w8a8@search+smooth" for r in data["plan"]["layers"])
    if model_type in NO_CT:
        assert NO_CT[model_type] in data["deployment"]["compressed-tensors"]
    if model_type in MOE:  # every layer planned; the plan says what the exports refuse, and quantize applies it
        assert data["objective"] == "weight bytes" and len(data["plan"]["layers"]) == len({l.index for l in
                                                                                      inspect_model(folder).layers})
        # the whole-model graph holds the experts as QMoE nodes: the note names a chosen recipe QMoE cannot store
        from ffnquant.deploy.onnx_experts import experts_recipe_refusal

        info = inspect_model(folder)
        refused = [r["recipe"] for r in data["plan"]["layers"]
                   if experts_recipe_refusal(Recipe.parse(r["recipe"]), info)]
        assert bool(data["deployment"]["onnx"]) == bool(refused or info.arch.matrix_experts), data["deployment"]
        assert main(["quantize", "--model", str(folder), "--plan", str(tmp_path / "p" / "plan.toml"), *TOKENS,
                     "--no-progress", "--no-onnx", "--out-reports", str(tmp_path / "qp")]) == 0
        capsys.readouterr()
        tied = _plan(folder, ["w4a16-g32"], tmp_path / "tied.toml")  # one recipe for every layer of experts
        rc = main(["export", "--model", str(folder), "--plan", str(tied), "--format", "compressed-tensors", *TOKENS,
                   *WINDOW, "--out", str(tmp_path / "ct")])
        err = capsys.readouterr().err
        assert rc == 0, err
        proof = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())["proof"]
        assert proof["proven"] and proof["weights"]["all_identical"] and proof["layers"]["all_at_parity"]
        # experts the model holds fused: stored per expert, read back through ffnquant's converters
        assert bool(proof["load"]["per_expert_loading"]) == (model_type in FUSED_EXPERTS)
        return
    capsys.readouterr()
    smoothed = _plan(folder, ["w8a8@search+smooth", "w4a16-g32"], tmp_path / "smoothed.toml")
    argv = ["export", "--model", str(folder), "--format", "compressed-tensors", *TOKENS, *WINDOW]
    rc = main([*argv, "--plan", str(smoothed), "--out", str(tmp_path / "ct")])
    err = capsys.readouterr().err
    if model_type in NO_CT:
        assert rc == 2 and NO_CT[model_type] in err
        return
    if model_type in NO_FOLD:
        assert rc == 2 and "cannot fold" in err and __import__("re").search(NO_FOLD[model_type], err), err
        assert not (tmp_path / "ct").exists()
        plain = _plan(folder, ["w8a8-dynamic-s8", "w4a16-g32"], tmp_path / "plain.toml")
        rc = main([*argv, "--plan", str(plain), "--out", str(tmp_path / "ct")])
    assert rc == 0, err
    doc = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["proven"] and doc["proof"]["weights"]["all_identical"]


def test_an_ffn_that_does_not_reproduce_is_refused_by_layer(folders):
    """Gate and up swapped (what a copied table row with other names would do): the check on the loaded model
    names each layer and its module before anything is quantized."""
    import dataclasses

    from ffnquant.errors import FFNQuantError
    from ffnquant.hf import load_ffn_layers
    from ffnquant.hf.capture import load_hf_model
    from ffnquant.hf.graph import check_reproduction

    info = inspect_model(folders["qwen3"])
    model = load_hf_model(info)
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    assert max(check_reproduction(model, info, load_ffn_layers(info), ids).values()) <= 1e-5
    swapped = dataclasses.replace(info.arch, roles={"gate_proj": "w_up", "up_proj": "w_gate", "down_proj": "w_down"})
    wrong = dataclasses.replace(info, arch=swapped)
    with pytest.raises(FFNQuantError, match=r"does not reproduce .* L0 \(model\.layers\.0\.mlp\): .*; L1 \(model\.layers\.1\.mlp\)"):
        check_reproduction(model, wrong, load_ffn_layers(wrong), ids)


@pytest.mark.parametrize("model_type", CAUSAL_TYPES)
def test_the_engine_equals_the_whole_forward(folders, model_type):
    """Every command runs a causal LM through one engine: the model's own class, a decoder layer at a time (sliding
    windows, norms after the FFN, parallel blocks, routers: all the class's own). Resident, and read from the
    safetensors a layer at a time where the checkpoint allows it, its figures are those of transformers' whole
    forward (`whole=True`), bit for bit: per-layer SQNR and every end-to-end figure."""
    from ffnquant.hf import EvalSettings, capture_layer_inputs, load_ffn_layers, quantize_model_layers
    from ffnquant.hf.layerwise import quantize_layerwise
    from ffnquant.hf.memory import streamable_reason

    info = inspect_model(folders[model_type])
    settings = EvalSettings(seq_len=32, batch_size=4, max_calib_tokens=128, max_eval_tokens=64, ablation=False)
    layers = load_ffn_layers(info)
    inputs = capture_layer_inputs(info, layers, calib_tokens=128, eval_tokens=64, settings=settings, whole=True)
    want = quantize_model_layers(info, layers, inputs, Recipe.parse("w8a8"), onnx=False, settings=settings)
    # every type read a layer at a time too: routed experts stored per expert are made from each expert's FFN as
    # `hf.checkpoint` reads it, those stored as held are read by name
    assert streamable_reason(info) is None
    modes = [True, False]
    for resident in modes:
        got = quantize_layerwise(info, Recipe.parse("w8a8"), calib_tokens=128, eval_tokens=64, settings=settings,
                                 onnx=False, resident=resident)
        assert [r["accuracy_torch"] for r in got["layers"]] == [r["accuracy_torch"] for r in want["layers"]], resident
        assert got["end_to_end"]["end_to_end"] == want["end_to_end"]["end_to_end"], resident


@pytest.mark.parametrize("model_type", ["falcon", "glm"])
def test_the_whole_model_onnx_graph_of_discovered_types(folders, model_type, tmp_path, capsys):
    """torch's exporter takes the model's own class: the float and planned graphs match the torch models (falcon:
    a parallel block of FalconLinear modules, which compressed-tensors refuses; glm: a fused gate+up)."""
    plan = _plan(folders[model_type], ["w8a8-dynamic-s8", "w4a16-g32"], tmp_path / "plan.toml")
    assert main(["export", "--model", str(folders[model_type]), "--plan", str(plan), "--format", "onnx",
                 "--out", str(tmp_path / "g"), *TOKENS]) == 0
    capsys.readouterr()
    graph = json.loads((tmp_path / "g" / "ffnquant-deploy.json").read_text())["graph"]
    assert graph["status"] == "ok" and graph["parity"]["float"]["passed"] and graph["parity"]["planned"]["passed"]


def test_the_plan_names_what_each_export_format_cannot_store(folders):
    from ffnquant.planning.job import deployment_notes

    info = inspect_model(folders["qwen3"])
    plan = Plan(model_fingerprint(info), {0: Recipe.parse("w8a8-dynamic-s8+rotate"), 1: Recipe.parse("w8a16")},
                "ppl+1%", "bytes")
    notes = deployment_notes(info, plan)
    assert "layer L0" in notes["compressed-tensors"] and "rotate" in notes["compressed-tensors"] and not notes["onnx"]
    assert deployment_notes(inspect_model(folders["gpt2"]))["onnx"].startswith("gpt2: its MLP weights are transformers' Conv1D")
    moe = inspect_model(folders["qwen3_moe"])
    # both formats store routed experts (the graph as QMoE nodes), fused on disk or not
    assert not deployment_notes(moe)["onnx"] and not deployment_notes(moe)["compressed-tensors"]
    fused = deployment_notes(inspect_model(folders["dbrx"]))  # stored fused: the folder writes them per expert
    assert not fused["compressed-tensors"] and not fused["onnx"]
    dynamic = Plan(model_fingerprint(moe), {0: Recipe.parse("w4a16-g32"), 1: Recipe.parse("w8a8-dynamic-s8")},
                   "ppl+1%", "bytes")
    assert "layer L1: routed experts cannot take w8a8-dynamic-s8" in deployment_notes(moe, dynamic)["onnx"]
    mixed = Plan(model_fingerprint(moe), {0: Recipe.parse("w4a16-g32"), 1: Recipe.parse("w8a16")}, "ppl+1%", "bytes")
    assert "2 recipes (L0 w4a16-g32, L1 w8a16)" in deployment_notes(moe, mixed)["compressed-tensors"]
