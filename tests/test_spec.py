import json

import pytest

from ffnquant.errors import FFNQuantError
from ffnquant.spec import SITES, FFNSpec, Variant, gated_width, parse_variant, parse_variants

GATED = [v for v in Variant if v.gated]
DENSE = [v for v in Variant if not v.gated]


@pytest.mark.parametrize(
    "d_model, multiple_of, multiplier, expected",
    [
        pytest.param(4096, 256, None, 11008, id="llama2-7b"),
        pytest.param(4096, 1024, 1.3, 14336, id="llama3-8b"),
        pytest.param(5120, 256, None, 13824, id="llama2-13b"),
        pytest.param(512, 1, None, 1365, id="bare-8/3"),
        pytest.param(512, 128, None, 1408, id="default-128"),
    ],
)
def test_gated_width_rule(d_model, multiple_of, multiplier, expected):
    assert gated_width(d_model, multiple_of, multiplier) == expected
    spec = FFNSpec("swiglu", d_model, multiple_of=multiple_of, ffn_dim_multiplier=multiplier)
    assert spec.d_ff == expected


@pytest.mark.parametrize("variant", DENSE, ids=str)
def test_dense_default_width_is_4d(variant):
    assert FFNSpec(variant, 512).d_ff == 2048


def test_relu_parameter_count_at_base_size():
    # 2 * 512 * 2048 weights + 2048 + 512 biases (the 2017 FFN)
    assert FFNSpec("relu", 512).n_params == 2_099_712


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_parameter_and_flop_counts_follow_the_matrices(variant):
    spec = FFNSpec(variant, 64, d_ff=96, bias=True)
    m = 3 if variant.gated else 2
    assert spec.n_matrices == m
    assert spec.n_weight_params == m * 64 * 96
    assert spec.n_bias_params == (m - 1) * 96 + 64
    assert spec.n_params == spec.n_weight_params + spec.n_bias_params
    assert spec.flops_per_token >= 2 * spec.n_weight_params
    assert set(spec.weight_shapes) == set(spec.weight_names)


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_default_bias_follows_design_table(variant):
    assert FFNSpec(variant).bias == (variant in (Variant.RELU, Variant.GELU, Variant.GELU_TANH))


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_sites_of_each_variant(variant):
    spec = FFNSpec(variant, 32)
    expected = SITES if variant.gated else tuple(s for s in SITES if s != "gate_pre")
    assert spec.sites == expected


@pytest.mark.parametrize("variant", list(Variant), ids=str)
def test_json_round_trip(variant):
    spec = FFNSpec(variant, 96, ffn_dim_multiplier=1.5)
    assert FFNSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize(
    "kwargs, message",
    [
        pytest.param({"variant": "swigl"}, "unknown variant 'swigl'; valid: relu", id="unknown-variant"),
        pytest.param({"variant": "relu", "d_model": 0}, "d_model must be a positive integer", id="zero-d"),
        pytest.param({"variant": "relu", "d_model": -4}, "d_model must be a positive integer", id="negative-d"),
        pytest.param({"variant": "relu", "d_ff": 0}, "d_ff must be a positive integer", id="zero-dff"),
        pytest.param({"variant": "relu", "d_model": 2.5}, "d_model must be a positive integer", id="float-d"),
        pytest.param({"variant": "swiglu", "multiple_of": 0}, "multiple_of must be", id="zero-multiple"),
        pytest.param({"variant": "swiglu", "ffn_dim_multiplier": -1.0}, "ffn_dim_multiplier", id="neg-mult"),
        pytest.param({"variant": "relu", "bias": "yes"}, "bias must be", id="bad-bias"),
        # sizes no tensor can hold, refused before any byte arithmetic can overflow
        pytest.param({"variant": "relu", "d_model": 10**10},
                     r"d_model 10000000000 x d_ff 40000000000 = 4e\+20 weights per matrix, beyond what any tensor can "
                     r"hold \(2\*\*62\): choose a smaller d_model or d_ff", id="matrix-overflow"),
        pytest.param({"variant": "swiglu", "d_model": 64, "d_ff": 2**60}, "beyond what any tensor can hold",
                     id="d_ff-overflow"),
        pytest.param({"variant": "relu", "ffn_dim_multiplier": 1e308}, "gives d_ff beyond any size",
                     id="multiplier-infinite-width"),
        pytest.param({"variant": "swiglu", "ffn_dim_multiplier": 1e-9}, "gives d_ff 0; choose a multiplier",
                     id="multiplier-zero-width"),
    ],
)
def test_bad_specs_raise_one_line_errors(kwargs, message):
    with pytest.raises(FFNQuantError, match=message) as info:
        FFNSpec(**kwargs)
    assert "\n" not in str(info.value)


def test_largest_describable_spec_is_accepted():
    # 10**9 x 4*10**9 is below 2**62: a valid spec (refused later, by the memory check, if ever built)
    assert FFNSpec("relu", d_model=10**9).d_ff == 4 * 10**9


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(FFNQuantError, match="unknown FFNSpec field"):
        FFNSpec.from_dict({"variant": "relu", "width": 3})


def test_parse_variants():
    assert parse_variants(None) == list(Variant)
    assert parse_variants("all") == list(Variant)
    assert parse_variants("swiglu, relu,swiglu") == [Variant.SWIGLU, Variant.RELU]
    assert parse_variant("GeGLU") is Variant.GEGLU
    with pytest.raises(FFNQuantError, match="valid: relu, gelu, gelu_tanh, swish, glu, bilinear, reglu, geglu, swiglu"):
        parse_variants("relu,nope")


@pytest.mark.parametrize("names", ["", " , ", []], ids=repr)
def test_parse_variants_refuses_an_empty_selection(names):
    with pytest.raises(FFNQuantError, match=r"^no variant given; valid: all, relu, gelu, .*, swiglu$"):
        parse_variants(names)
