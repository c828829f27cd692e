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


# --- sizes that cannot fit: refused before allocating --------------------------------------------

GB = 10**9


@pytest.fixture
def memory_8gb(monkeypatch):
    """The machine reports 8 GB available, whatever it has: the checks answer the same everywhere."""
    from ffnquant.infra import resources

    monkeypatch.setattr(resources, "available_memory", lambda: 8 * GB)


@pytest.mark.parametrize(
    "make, message",
    [
        pytest.param(lambda: build(FFNSpec("relu", 10**9)),
                     r"relu at d_model 1000000000 \(d_ff 4000000000\) needs 48\.0 EB for its weights; "
                     r"this machine has 8\.0 GB available: choose a smaller d_model \(or d_ff\)", id="build-huge"),
        pytest.param(lambda: build(FFNSpec("swiglu", 32768)), r"swiglu at d_model 32768 \(d_ff 87424\) needs 4\d\.\d GB",
                     id="build-just-too-big"),
        pytest.param(lambda: FFN(FFNSpec("relu", 40000)), r"relu at d_model 40000 \(d_ff 160000\) needs 51\.2 GB",
                     id="module-too-big"),
        pytest.param(lambda: build(FFNSpec("gelu", 24000), dtype=torch.float16), r"gelu at d_model 24000 .* needs \d",
                     id="build-fp16-with-cast-copy"),
    ],
)
def test_sizes_that_cannot_fit_are_refused_before_allocating(memory_8gb, make, message):
    with pytest.raises(FFNQuantError, match=message) as info:
        make()
    assert "\n" not in str(info.value)


def test_sizes_that_fit_are_built(memory_8gb):
    # ~113 MB with the random temporary: above the size below which memory is not checked, well within 8 GB
    assert build(FFNSpec("relu", 1536)).w_up.weight.shape == (6144, 1536)


def test_unknown_memory_skips_the_check(monkeypatch):
    from ffnquant.infra import resources

    monkeypatch.setattr(resources, "available_memory", lambda: None)
    resources.check_memory(10**30, "anything", "no hint")  # no estimate: no refusal


@pytest.mark.parametrize(
    "argv",
    [
        pytest.param(["export", "--variants", "relu", "--dtypes", "fp32", "--d-model", "1000000000"], id="export"),
        pytest.param(["profile", "--variants", "relu", "--d-model", "1000000000"], id="profile"),
        pytest.param(["bench", "--variants", "relu", "--d-model", "1000000000", "--runtimes", "torch-cpu"], id="bench"),
        pytest.param(["quantize", "--variants", "swiglu", "--d-model", "1000000000"], id="quantize"),
        pytest.param(["run", "--tiny", "--d-model", "1000000000", "--runtimes", "none"], id="run"),
        pytest.param(["run", "--config", "{tmp}/run.toml", "--runtimes", "none"], id="run-config"),
    ],
)
def test_cli_refuses_sizes_that_cannot_fit_with_exit_2(memory_8gb, tmp_path, capsys, argv):
    from ffnquant.cli import main

    (tmp_path / "run.toml").write_text("d_model = 1000000000\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    out_flags = {"export": ["--out"], "profile": ["--out"], "bench": ["--out"], "run": ["--out", "--export"],
                 "quantize": ["--out-reports", "--out-artifacts"]}[argv[0]]
    for i, flag in enumerate(out_flags):
        argv += [flag, str(tmp_path / f"out{i}")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "needs" in err and "this machine has 8.0 GB available: choose a smaller d_model" in err, err
    assert "\n" not in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.toml"]  # nothing written


def test_weights_file_that_is_a_fifo_is_refused(tmp_path):
    import os

    os.mkfifo(tmp_path / "w.safetensors")  # safe_open would block on it forever
    with pytest.raises(FFNQuantError, match=r"weights file '.*w\.safetensors' is a FIFO, not a regular file"):
        load_weights(tmp_path / "w.safetensors")


def test_an_ffn_of_a_models_own_activation_computes_with_the_module_it_is_given():
    """Activation 'own' (a model's activation module, learned parameters per layer): the FFN computes with the
    module given, carries it in its state and copies; built without one it refuses to run, by name."""
    from torch import nn

    from ffnquant.spec import Activation

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.alpha = nn.Parameter(torch.tensor([1.5]))

        def forward(self, x):
            return torch.tanh(x) * self.alpha

    spec = FFNSpec("relu", d_model=8, d_ff=16, bias=False, activation_override="own")
    assert spec.activation is Activation.OWN
    ffn = FFN(spec, activation=Scaled())
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = ffn.w_down(torch.tanh(ffn.w_up(x)) * 1.5)
        assert torch.equal(ffn(x), want)
    assert "activation.alpha" in ffn.state_dict()
    copy_ = ffn.own_activation()
    assert copy_ is not ffn.activation and torch.equal(copy_.alpha, ffn.activation.alpha)
    state = {k: v for k, v in ffn.state_dict().items() if not k.startswith("activation.")}
    with torch.no_grad():
        assert torch.equal(FFN.from_state(spec, state, activation=copy_)(x), want)
    with pytest.raises(FFNQuantError, match="own activation module .* which it was built without"):
        FFN(spec)(x)
    with pytest.raises(FFNQuantError, match="activation module only where its spec's activation is 'own'"):
        FFN(FFNSpec("relu", d_model=8), activation=Scaled())


def test_an_ffn_of_a_models_own_gate_function_computes_it_of_gate_and_up():
    """Activation 'own_gate': hidden = fn(gate, up), the model's function of both (a clamped SwiGLU); the act site
    sees its output; a dense FFN cannot have one."""
    from torch import nn

    class Clamped(nn.Module):
        def forward(self, gate, up):
            return torch.sigmoid(gate.clamp(max=1.0)) * (up.clamp(-1.0, 1.0) + 1)

    spec = FFNSpec("reglu", d_model=8, d_ff=16, activation_override="own_gate")
    ffn = FFN(spec, activation=Clamped())
    seen = {}
    ffn.taps["act"].register_forward_hook(lambda m, i, o: seen.setdefault("act", o))
    x = torch.randn(4, 8) * 3
    with torch.no_grad():
        gate, up = ffn.w_gate(x), ffn.w_up(x)
        want_hidden = torch.sigmoid(gate.clamp(max=1.0)) * (up.clamp(-1.0, 1.0) + 1)
        assert torch.equal(ffn(x), ffn.w_down(want_hidden))
    assert torch.equal(seen["act"], want_hidden)
    with pytest.raises(FFNQuantError, match="own_gate' is a function of gate and up: a gated FFN's only"):
        FFN(FFNSpec("relu", d_model=8, activation_override="own_gate"), activation=Clamped())
