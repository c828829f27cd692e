"""Remedies: exact in float for every variant they apply to, refused where the fold would change the function."""

import pytest
import torch

from ffnquant import FFNSpec, Variant, build
from ffnquant.data import llm_like_tokens
from ffnquant.errors import FFNQuantError
from ffnquant.numerics.observe import profile
from ffnquant.numerics.remedies import BlockHadamard, hadamard, hadamard_block_size, rotate, smooth, smooth_exact_for

D = 64
X = llm_like_tokens(512, D, 0, 4, 50.0)
EXACT_HIDDEN = [v for v in Variant if v.gated or v is Variant.RELU]
NOT_EXACT_HIDDEN = [Variant.GELU, Variant.GELU_TANH, Variant.SWISH]


def _setup(variant):
    model = build(FFNSpec(variant, d_model=D), seed=3)
    table = profile(model, [X], sites=["input", "hidden"], weights=False)
    with torch.no_grad():
        ref = model(X)
    return model, table, ref


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("variant", EXACT_HIDDEN, ids=str)
@pytest.mark.parametrize("alpha", [0.3, 0.8], ids=lambda a: f"alpha{a}")
def test_smooth_is_exact_where_it_folds(variant, alpha):
    model, table, ref = _setup(variant)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new, record = smooth(model, table, alpha)
    with torch.no_grad():
        assert _rel(new(X), ref) < 1e-5  # float32 rounding only
    assert record.kind == "smooth" and set(record.details) == {"input", "hidden"}
    assert len(record.details["input"]["input_scale_to_fold_into_norm"]) == D
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # original untouched


@pytest.mark.parametrize("variant", EXACT_HIDDEN, ids=str)
def test_smooth_flattens_the_hidden_channels(variant):
    model, table, _ = _setup(variant)
    new, _ = smooth(model, table, 0.5)
    t2 = profile(new, [X], sites=["input", "hidden"], weights=False)
    for site in ("input", "hidden"):
        spread = lambda t: float(t[site].channel_absmax.max() / max(t[site].channel_absmax.mean(), 1e-12))  # noqa: E731
        assert spread(t2) < spread(table)


@pytest.mark.parametrize("variant", NOT_EXACT_HIDDEN, ids=str)
def test_smooth_refuses_non_homogeneous_dense_hidden(variant):
    model, table, ref = _setup(variant)
    assert smooth_exact_for(model) == {"input": True, "hidden": False}
    with pytest.raises(FFNQuantError, match="cannot fold the hidden scale .* exactly"):
        smooth(model, table, 0.5)
    new, record = smooth(model, table, 0.5, sites=("input",))  # the input fold is exact for every variant
    with torch.no_grad():
        assert _rel(new(X), ref) < 1e-5
    assert set(record.details) == {"input"}


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_rotate_is_exact(variant):
    model, _, ref = _setup(variant)
    new, record = rotate(model)
    with torch.no_grad():
        assert _rel(new(X), ref) < 1e-5
    assert isinstance(new.hidden_transform, BlockHadamard)
    assert record.params["block"] == hadamard_block_size(model.spec.d_ff, 256)


def test_smooth_then_rotate_is_exact_and_rotate_twice_is_refused():
    model, table, ref = _setup(Variant.SWIGLU)
    new, _ = smooth(model, table, 0.5)
    new, _ = rotate(new)
    with torch.no_grad():
        assert _rel(new(X), ref) < 1e-5
    with pytest.raises(FFNQuantError, match="already transformed"):
        rotate(new)


@pytest.mark.parametrize(
    "d_ff, block",
    [pytest.param(1408, 128, id="1408"), pytest.param(11008, 256, id="11008-llama2"), pytest.param(2048, 2048, id="2048")],
)
def test_block_size_is_the_largest_power_of_two_dividing_d_ff(d_ff, block):
    assert hadamard_block_size(d_ff) == block
    assert hadamard_block_size(11008, max_block=256) == 256


def test_hadamard_is_orthogonal_and_odd_widths_are_refused():
    q = BlockHadamard(384, 128).matrix()
    assert torch.allclose(q @ q.T, torch.eye(384), atol=1e-5)
    assert torch.equal(hadamard(4), torch.tensor([[1.0, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]))
    model = build(FFNSpec(Variant.RELU, d_model=16, d_ff=45))
    with pytest.raises(FFNQuantError, match="odd"):
        rotate(model)


def test_smooth_rejects_bad_alpha_and_sites():
    model, table, _ = _setup(Variant.SWIGLU)
    with pytest.raises(FFNQuantError, match=r"alpha must be in \[0, 1\]"):
        smooth(model, table, 1.5)
    with pytest.raises(FFNQuantError, match="unknown smooth site 'output'"):
        smooth(model, table, 0.5, sites=("output",))
