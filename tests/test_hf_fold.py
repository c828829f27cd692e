"""ffnquant.hf.fold: FFN input scales folded into the norm before each FFN of tiny generated transformers models."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.hf import inspect_model, load_ffn_layers
from ffnquant.hf.arch import ARCHITECTURES, NormGain
from ffnquant.numerics.remedies import ChannelScale

from hf_models import VOCAB, tiny_folders

FOLDABLE = ["llama", "mistral", "qwen2", "gemma", "phi3", "t5", "t5-gated-gelu", "gpt2", "opt"]
# bert by its hand-written entry; mixtral from its graph: the router reads the norm's output too
REFUSED = {"bert": "of a bert model: post-LN.*residual", "mixtral": r"also read by model\.layers\.0\.mlp\.gate"}
# Folding moves one float32 rounding (2^-24 relative) from the FFN's multiply into the norm's stored gain;
# over two blocks that stays orders of magnitude below the 1e-5 on the logits.
TOL = 1e-5

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    return tiny_folders(tmp_path_factory, FOLDABLE + list(REFUSED))


def _loaded(tiny_models, name):
    """(model, info, layers) with every norm's gain and bias drawn at random: the fresh models' ones and zeros
    would hide a fold that forgot the bias or Gemma's 1 + g."""
    from ffnquant.hf.capture import load_hf_model

    info = inspect_model(tiny_models[name][0])
    model = load_hf_model(info)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for mod_name, module in model.named_modules():
            if "norm" in type(module).__name__.lower():
                for attr, base in (("weight", 0.0 if info.arch.norm_gain is NormGain.ONE_PLUS_GAIN else 1.0), ("bias", 0.0)):
                    t = getattr(module, attr, None)
                    if isinstance(t, torch.Tensor):
                        t.copy_(base + 0.3 * torch.randn(t.shape, generator=gen))
    return model, info, load_ffn_layers(info)


def _smoothed(layers, seed=0):
    """Each FFN with x * c before it and 1/c in its input weight columns (the same function), c log-uniform
    over [1e-2, 1e2]."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        d = layer.spec.d_model
        c = torch.exp(torch.empty(d).uniform_(math.log(1e-2), math.log(1e2), generator=gen))
        ffn = copy.deepcopy(layer.ffn)
        ffn.input_transform = ChannelScale(c)
        with torch.no_grad():
            for lin in [ffn.w_up] + ([ffn.w_gate] if ffn.w_gate is not None else []):
                lin.weight.div_(c[None, :])
        out[layer.info] = ffn
    return out


def _rel(ref, got):
    """max |a - b| / max |a|: the relative difference fold_exactness reports."""
    return float((got.double() - ref.double()).abs().max() / ref.double().abs().max())


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", FOLDABLE, ids=str)
def test_folded_model_computes_what_the_smoothed_one_did(tiny_models, name):
    from ffnquant.hf.capture import install_ffns
    from ffnquant.hf.fold import _compared, fold_input_scales, norm_module

    model, info, layers = _loaded(tiny_models, name)
    smoothed = _smoothed(layers)
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = _compared(model, info, ids)
    with install_ffns(model, info, smoothed):
        unfolded = _compared(model, info, ids)
    from ffnquant.hf.graph import fold_sites

    norms = {layer: norm_module(model, info, layer)[1] for layer in smoothed}
    gains = {layer: norm.weight.detach().clone() for layer, norm in norms.items()}
    forms = {layer: site.gain for layer, site in fold_sites(model, info, list(smoothed)).items()}
    plain = fold_input_scales(model, info, smoothed)
    with install_ffns(model, info, plain):
        folded = _compared(model, info, ids)
    assert _rel(ref, folded) <= TOL and _rel(unfolded, folded) <= TOL
    for layer, ffn in plain.items():
        assert isinstance(ffn.input_transform, torch.nn.Identity)
        assert isinstance(smoothed[layer].input_transform, ChannelScale)  # the given FFNs are left as they were
        assert ffn.w_up.weight is smoothed[layer].w_up.weight  # weights shared, not copied
        c = smoothed[layer].input_transform.scale.double()
        g = gains[layer].double()
        want = (1 + g) * c - 1 if forms[layer] is NormGain.ONE_PLUS_GAIN else g * c
        torch.testing.assert_close(norms[layer].weight.double(), want, rtol=2**-23, atol=2**-23)
    # the fold does real work: the scale-free FFNs in the model as it was loaded are far off
    with torch.no_grad():
        for layer, norm in norms.items():
            norm.weight.copy_(gains[layer])
    with install_ffns(model, info, plain):
        assert _rel(ref, _compared(model, info, ids)) > 1e-2


@pytest.mark.parametrize("name", ["gpt2", "gemma", "t5"], ids=str)
def test_context_manager_restores_the_norms_bit_for_bit(tiny_models, name):
    from ffnquant.hf.fold import folded_input_scales

    model, info, layers = _loaded(tiny_models, name)
    before = _state(model)
    smoothed = _smoothed(layers, seed=1)
    with folded_input_scales(model, info, smoothed) as plain:
        changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
        assert len(plain) == len(layers) and changed
        assert all("norm" in k or "ln_2" in k for k in changed)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError, match="boom"), folded_input_scales(model, info, smoothed):
        raise RuntimeError("boom")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", sorted(REFUSED), ids=str)
def test_refused_architectures_name_the_reason_and_change_nothing(tiny_models, name):
    from ffnquant.hf.fold import fold_exactness, fold_input_scales, fold_refusal

    model, info, layers = _loaded(tiny_models, name)
    before = _state(model)
    assert (fold_refusal(info) is not None) == (name == "bert")
    with pytest.raises(FFNQuantError, match=REFUSED[name]) as err:
        fold_input_scales(model, info, _smoothed(layers))
    assert "\n" not in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    # FFNs without an input scale need no fold: returned as given
    plain = {layer.info: layer.ffn for layer in layers}
    assert all(fold_input_scales(model, info, plain)[k] is v for k, v in plain.items())
    with pytest.raises(FFNQuantError, match=REFUSED[name]):
        fold_exactness((model, info))


def test_post_ln_opt_is_refused_from_its_graph(tmp_path):
    """OPT with do_layer_norm_before false (opt-350m): the norm before the FFN is also the residual, which no
    hook sees; the numeric check (scale the gain, unscale the FFN, compare the logits) refuses it."""
    import transformers

    from ffnquant.hf.capture import load_hf_model
    from ffnquant.hf.fold import fold_input_scales
    from hf_models import D, F_, VOCAB as V, tokenizer

    config = transformers.OPTConfig(vocab_size=V, hidden_size=D, ffn_dim=F_, num_hidden_layers=2, num_attention_heads=4,
                                    max_position_embeddings=64, word_embed_proj_dim=D, do_layer_norm_before=False)
    torch.manual_seed(0)
    transformers.OPTForCausalLM(config).save_pretrained(tmp_path / "opt-post-ln")
    tokenizer(transformers).save_pretrained(tmp_path / "opt-post-ln")
    info = inspect_model(tmp_path / "opt-post-ln")
    model = load_hf_model(info)
    before = _state(model)
    with pytest.raises(FFNQuantError, match=r"L0: folding a scale into model\.decoder\.layers\.0\..*layer_norm changes the "
                                            r"model's output by .* another way than through the FFN"):
        fold_input_scales(model, info, _smoothed(load_ffn_layers(info)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("name", FOLDABLE + ["bert"], ids=str)
def test_the_norm_output_is_the_ffn_input(tiny_models, name):
    """Arch.norm_pattern names the right module: its output is, bit for bit, what the FFN receives."""
    from ffnquant.hf.capture import ffn_input_hooks
    from ffnquant.hf.fold import _compared, norm_module

    model, info, layers = _loaded(tiny_models, name)
    ffn_in, norm_out, handles = {}, {}, []
    norms = {layer.label: norm_module(model, info, layer.info) for layer in layers}  # found by running the model
    for layer in layers:
        norm_name, norm = norms[layer.label]
        assert norm_name.endswith(("post_attention_layernorm", "layer_norm", "ln_2", "final_layer_norm", "LayerNorm"))
        def keep(module, args, out, label=layer.label):  # returns None: the output passes unchanged
            norm_out.setdefault(label, out.detach().reshape(-1, out.shape[-1]).clone())

        handles.append(norm.register_forward_hook(keep))
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    try:
        with ffn_input_hooks(model, info, [l.info for l in layers], lambda l, x: ffn_in.setdefault(l.label, x)):
            _compared(model, info, ids)
    finally:
        for h in handles:
            h.remove()
    assert sorted(ffn_in) == sorted(norm_out) == sorted(l.label for l in layers)
    for label, x in ffn_in.items():
        assert torch.equal(x, norm_out[label])


def test_every_architecture_names_its_norm_or_why_not():
    for name, arch in ARCHITECTURES.items():
        why = arch.fold_refusal({})
        assert arch.norm_pattern and (why is None) == (name not in ("bert", "mixtral")), name


def test_quantized_ffn_folds_with_its_quantizers(tiny_models):
    from ffnquant.methods.fakequant import QuantizedFFN, quantize_model
    from ffnquant.hf.fold import folded_input_scales

    model, info, layers = _loaded(tiny_models, "llama")
    smoothed = _smoothed(layers[:1])
    (layer, ffn), = smoothed.items()
    q = quantize_model(ffn, "w8a8-dynamic")
    with folded_input_scales(model, info, {layer: q}) as plain:
        q2 = plain[layer]
    assert isinstance(q2, QuantizedFFN) and q2 is not q and q2.model is not q.model
    assert isinstance(q2.model.input_transform, torch.nn.Identity) and isinstance(q.model.input_transform, ChannelScale)
    assert q2.model.w_up.weight is q.model.w_up.weight and q2.quantized_sites == q.quantized_sites
    x = torch.randn(16, info.spec.d_model, generator=torch.Generator().manual_seed(4))
    c = q.model.input_transform.scale
    with torch.no_grad():
        torch.testing.assert_close(q2(x * c), q(x), rtol=1e-5, atol=1e-5)
        # the copy's activation quantizers are its own: removing them leaves the original's in place
        q2.remove_hooks()
        assert all(len(q.model.taps[s]._forward_hooks) == 1 for s in q.quantized_sites)
        assert all(not q2.model.taps[s]._forward_hooks for s in q.quantized_sites)


def test_other_input_transforms_are_refused(tiny_models):
    from ffnquant.hf.fold import fold_input_scales

    model, info, layers = _loaded(tiny_models, "gpt2")
    ffn = copy.deepcopy(layers[0].ffn)
    ffn.input_transform = torch.nn.Tanh()
    with pytest.raises(FFNQuantError, match="L0: its input_transform is a Tanh, not a per-channel scale"):
        fold_input_scales(model, info, {layers[0].info: ffn})


@pytest.mark.parametrize("name", ["llama", "gpt2"], ids=str)
def test_fold_exactness_on_a_tiny_model(tiny_models, name):
    from ffnquant.hf.fold import fold_exactness

    model, info, _ = _loaded(tiny_models, name)
    before = _state(model)
    r = fold_exactness((model, info), alpha=0.5, tokens=64, seq_len=16)
    assert r["within_tolerance"] and r["max_rel_diff"] <= TOL and r["folded_vs_unfolded"]["max_rel_diff"] <= TOL
    assert r["layers"] == ["L0", "L1"] and r["tokens"] == 64 and r["compared"] == "logits"
    assert r["float_ffns"]["max_rel_diff"] <= TOL and r["unfolded"]["max_rel_diff"] <= TOL
    assert r["mean_rel_diff"] <= TOL and 0 < r["norm_factor_min"] <= r["norm_factor_max"]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the model is left as given


@pytest.mark.parametrize("n", [1, 7, 16, 33], ids=lambda n: f"{n}-values")
def test_the_difference_is_streamed_in_chunks_with_the_whole_tensors_figures(n, monkeypatch):
    """`_Diff` takes float64 copies a chunk at a time (a batch of a 262k-vocabulary model's logits is gigabytes):
    its maxima are the whole tensors', its sums theirs up to float64 summation order."""
    from ffnquant.hf.fold import _Diff

    monkeypatch.setattr(_Diff, "CHUNK", 8)
    gen = torch.Generator().manual_seed(n)
    ref, got = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    diff = _Diff()
    diff.update(ref.reshape(1, -1), got.reshape(1, -1))
    r, d = ref.double().abs(), (got.double() - ref.double()).abs()
    assert diff.max_diff == float(d.max()) and diff.max_ref == float(r.max())
    assert diff.sum_diff == pytest.approx(float(d.sum()), rel=1e-15) and diff.sum_ref == pytest.approx(float(r.sum()), rel=1e-15)
