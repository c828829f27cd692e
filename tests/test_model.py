import numpy as np
import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.model import FFN, build, load_weights, save_weights
from ffnquant.spec import FFNSpec, Variant


def numpy_ffn(model: FFN, x: np.ndarray, act) -> dict[str, np.ndarray]:
    """The seed formulas in float64 numpy: dense down(f(x W1 + b1)), gated down(f(x V) * (x W))."""
    p = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}

    def linear(name, z):
        y = z @ p[f"{name}.weight"].T
        return y + p[f"{name}.bias"] if f"{name}.bias" in p else y

    sites = {"input": x, "up": linear("w_up", x)}
    if model.spec.gated:
        sites["gate_pre"] = linear("w_gate", x)
        sites["act"] = act(model.spec.activation.value, sites["gate_pre"])
        sites["hidden"] = sites["act"] * sites["up"]
    else:
        sites["act"] = act(model.spec.activation.value, sites["up"])
        sites["hidden"] = sites["act"]
    sites["output"] = linear("w_down", sites["hidden"])
    return sites


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_module_matches_numpy_seed_formulas_at_every_site(variant, bias, numpy_reference):
    spec = FFNSpec(variant, 32, d_ff=48, bias=bias)
    model = build(spec, seed=3).double()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    seen = {}
    handles = [model.taps[s].register_forward_hook(lambda m, i, o, s=s: seen.__setitem__(s, o.detach())) for s in spec.sites]
    with torch.no_grad():
        out = model(x)
    for h in handles:
        h.remove()
    ref = numpy_ffn(model, x.numpy(), numpy_reference)
    assert set(seen) == set(spec.sites)
    for site in spec.sites:
        np.testing.assert_allclose(seen[site].numpy(), ref[site], rtol=1e-10, atol=1e-12, err_msg=site)
    np.testing.assert_allclose(out.numpy(), ref["output"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_weights_are_named_and_shaped(variant):
    spec = FFNSpec(variant, 16, d_ff=24)
    model = build(spec)
    weights = model.weights()
    assert tuple(weights) == spec.weight_names
    assert {k: tuple(v.shape) for k, v in weights.items()} == spec.weight_shapes
    n = sum(p.numel() for p in model.parameters())
    assert n == spec.n_params


def test_initialisation_is_deterministic_per_seed():
    spec = FFNSpec("swiglu", 32)
    a, b, c = build(spec, seed=7), build(spec, seed=7), build(spec, seed=8)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k])
    assert not torch.equal(a.w_up.weight, c.w_up.weight)


def test_init_scale_is_one_over_sqrt_fan_in():
    spec = FFNSpec("relu", 256)
    w = build(spec, seed=0).w_up.weight
    assert abs(w.std().item() * 256**0.5 - 1.0) < 0.02


def test_a_replacing_hook_changes_only_what_it_replaces():
    spec = FFNSpec("swiglu", 16)
    model = build(spec)
    x = torch.randn(3, 16)
    ref = model(x)
    h = model.taps["hidden"].register_forward_hook(lambda m, i, o: torch.zeros_like(o))
    out = model(x)
    h.remove()
    assert torch.count_nonzero(out) == 0
    assert torch.equal(model(x), ref)


@pytest.mark.parametrize("variant", [Variant.RELU, Variant.SWIGLU], ids=str)
def test_safetensors_round_trip(variant, tmp_path):
    model = build(FFNSpec(variant, 32), seed=5)
    path = save_weights(model, tmp_path / "w.safetensors")
    loaded = load_weights(path)
    assert loaded.spec == model.spec
    x = torch.randn(4, 32)
    assert torch.equal(loaded(x), model(x))
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"]  # no temp files left


def test_load_weights_errors(tmp_path):
    with pytest.raises(FFNQuantError, match="does not exist"):
        load_weights(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(FFNQuantError, match="cannot read safetensors file"):
        load_weights(bad)
    path = save_weights(build(FFNSpec("relu", 32)), tmp_path / "relu.safetensors")
    with pytest.raises(FFNQuantError, match="does not match"):
        load_weights(path, spec=FFNSpec("swiglu", 32))
    with pytest.raises(FFNQuantError, match=r"tensor w_up.weight has shape \(128, 32\), expected \(64, 32\)"):
        load_weights(path, spec=FFNSpec("relu", 32, d_ff=64))
