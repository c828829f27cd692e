"""Property-based cases (hypothesis) of the two input parsers every command relies on (issue 15).

- The recipe grammar `ffnquant.recipe.GRAMMAR` (`ffnquant.recipe.Recipe.parse`):
  valid recipes round-trip through their text form, and any text either parses or raises
  FFNQuantError with a one-line message, never another exception.
- The token-file reader (`ffnquant.data.load_tokens`): small arrays of the supported float
  dtypes, in either byte order, load to float32 values equal to the input; unsupported dtypes,
  shapes, values and corrupt files raise FFNQuantError with one line, never another exception.
"""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ffnquant.numerics.calibrate import calibrator_names
from ffnquant.data import load_tokens
from ffnquant.errors import FFNQuantError
from ffnquant.recipe import Recipe, parse_recipe
from ffnquant.schemes import PRESETS

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def one_line(exc: BaseException) -> str:
    text = str(exc)
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"not one line: {text!r}"
    assert text == text.strip(), f"leading/trailing whitespace in the message: {text!r}"
    return text


# --- the recipe grammar ----------------------------------------------------------------

CALIBRATORS = [c for c in calibrator_names()] + ["percentile:99", "percentile:99.9", "percentile:99.99", "percentile:100"]
STATIC = sorted(name for name, s in PRESETS.items() if s.static_activations)
QUANTIZED = sorted(name for name, s in PRESETS.items() if not s.weight_dtype.is_float)


@st.composite
def recipes(draw, alphas=st.integers(0, 100).map(lambda k: k / 100)) -> Recipe:
    """A Recipe the grammar allows: a calibrator only on static schemes, remedies only on quantized ones."""
    scheme = draw(st.sampled_from(sorted(PRESETS)))
    calibrator = draw(st.none() | st.sampled_from(CALIBRATORS)) if scheme in STATIC else None
    smooth = draw(st.none() | alphas) if scheme in QUANTIZED else None
    rotate = draw(st.booleans()) if scheme in QUANTIZED else False
    return Recipe(scheme, calibrator, smooth, rotate)


@SETTINGS
@given(recipes())
def test_valid_recipes_round_trip(recipe):
    assert parse_recipe(recipe.name) == recipe
    assert parse_recipe(recipe.name).name == recipe.name


@SETTINGS
@given(recipes(alphas=st.floats(0.0, 1.0, allow_nan=False)))
def test_recipe_text_keeps_the_exact_smooth_strength(recipe):
    """run.toml stores recipes by their text: a smooth strength the user gave must come back unchanged
    (e.g. 0.1234567, not 0.123457), or `ffnquant run --config run.toml` does not repeat the run."""
    assert parse_recipe(recipe.name) == recipe


@st.composite
def recipe_texts(draw) -> str:
    """Recipe text as a user types it: any letter case, spaces around '@' and '+', remedies in any order."""
    recipe = draw(recipes())
    case = draw(st.sampled_from([str.lower, str.upper, str.title]))
    sp = draw(st.sampled_from(["", " ", "  "]))
    text = case(recipe.scheme) + (f"{sp}@{sp}{recipe.calibrator}" if recipe.calibrator else "")
    mods = []
    if recipe.smooth is not None:
        word = draw(st.sampled_from(["smooth", "SMOOTH", "Smooth"]))
        bare = recipe.smooth == 0.5 and draw(st.booleans())  # 0.5 is the default strength
        mods.append(word if bare else f"{word}={recipe.smooth!r}")
    if recipe.rotate:
        mods.append(draw(st.sampled_from(["rotate", "ROTATE"])))
    mods = draw(st.permutations(mods))
    return sp + text + "".join(f"{sp}+{sp}{m}" for m in mods) + sp


@SETTINGS
@given(recipe_texts())
def test_typed_recipes_parse_to_their_canonical_name(text):
    recipe = parse_recipe(text)
    assert parse_recipe(recipe.name) == recipe
    assert parse_recipe(recipe.name).name == recipe.name


GRAMMAR_PIECES = [
    "w8a8", "W8A8", "fp32", "fp16", "w8a8-dynamic", "w4a16-g128", "nf4", "fp8-e4m3", "bogus", "",
    "@", "@@", "+", "++", "=", "==", ":", "smooth", "rotate", "smooth=", "=0.5", "0.3", "1", "1.5", "-0.1", "nan", "inf",
    "-inf", "1e400", "1_0", "0x1", "auto", "mse", "search", "minmax", "entropy", "percentile", "percentile:", "99.9",
    "0", "101", " ", "\t", "\n", "\r", "\x00", "\x85", "\u2028", "é", "İ", "'", '"', "\\", "{", "}", "%s", "{0}",
]


@SETTINGS
@given(st.one_of(st.text(max_size=40), st.lists(st.sampled_from(GRAMMAR_PIECES), max_size=10).map("".join)))
def test_any_text_parses_or_is_refused_in_one_line(text):
    try:
        recipe = parse_recipe(text)
    except FFNQuantError as exc:
        one_line(exc)
        return
    assert isinstance(recipe, Recipe)
    assert parse_recipe(recipe.name) == recipe


# --- the token-file reader -----------------------------------------------------------------

FLOAT_DTYPES = [np.dtype(f"{order}{kind}") for kind in ("f2", "f4", "f8") for order in ("<", ">")]
shapes = st.one_of(hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=8),
                   hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=5))


@st.composite
def float_arrays(draw) -> np.ndarray:
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    shape = draw(shapes)
    # finite, and within float32's range: a float64 beyond it has no float32 value to load as
    bound = float(np.finfo(np.float32).max) if dtype.itemsize == 8 else None
    elements = st.floats(min_value=bound and -bound, max_value=bound, allow_nan=False, allow_infinity=False,
                         width=8 * dtype.itemsize)
    return draw(hnp.arrays(dtype, shape, elements=elements))


def _save_npy(array: np.ndarray, folder: Path, allow_pickle: bool = False) -> Path:
    path = folder / "tokens.npy"
    np.save(path, array, allow_pickle=allow_pickle)
    return path


@SETTINGS
@given(float_arrays(), st.booleans())
def test_float_npy_loads_to_equal_float32(array, give_d_model):
    with tempfile.TemporaryDirectory() as tmp:
        path = _save_npy(array, Path(tmp))
        got = load_tokens(path, d_model=array.shape[-1] if give_d_model else None)
    assert got.dtype == torch.float32
    want = array.astype(np.float32).reshape(-1, array.shape[-1])
    assert tuple(got.shape) == want.shape
    np.testing.assert_array_equal(got.numpy(), want)


@SETTINGS
@given(float_arrays(), st.sampled_from(["acts", "x.y", "layer 0"]))
def test_float_safetensors_loads_to_equal_float32(array, name):
    from safetensors.numpy import save_file

    array = array.astype(array.dtype.newbyteorder("<"))  # safetensors stores little-endian
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.safetensors"
        save_file({name: np.ascontiguousarray(array)}, str(path))
        got = load_tokens(path)
        named = load_tokens(path, name=name)
    want = array.astype(np.float32).reshape(-1, array.shape[-1])
    np.testing.assert_array_equal(got.numpy(), want)
    np.testing.assert_array_equal(named.numpy(), want)


@SETTINGS
@given(hnp.arrays(np.float32, shapes, elements=st.floats(-1e4, 1e4, width=32)))
def test_bfloat16_safetensors_loads_to_equal_float32(array):
    from safetensors.torch import save_file

    t = torch.from_numpy(array).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tokens.safetensors"
        save_file({"acts": t}, str(path))
        got = load_tokens(path)
    assert torch.equal(got, t.to(torch.float32).reshape(-1, array.shape[-1]))


UNSUPPORTED_DTYPES = [np.dtype(d) for d in ("i1", "i2", "<i4", ">i4", "i8", "u1", "u2", "u4", "u8", "?", "c8", ">c16",
                                            "U3", "S3", "M8[s]", "m8[s]", "V4", [("a", "<f4"), ("b", "<f4")])]
if np.dtype(np.longdouble).itemsize > 8:
    UNSUPPORTED_DTYPES.append(np.dtype(np.longdouble))


@SETTINGS
@given(st.sampled_from(UNSUPPORTED_DTYPES), shapes)
def test_unsupported_dtype_is_refused_in_one_line(dtype, shape):
    array = np.zeros(shape, dtype=dtype)
    with tempfile.TemporaryDirectory() as tmp:
        path = _save_npy(array, Path(tmp))
        with pytest.raises(FFNQuantError) as info:
            load_tokens(path)
    one_line(info.value)
    assert "float32" in str(info.value)  # the message lists what is supported


@SETTINGS
@given(st.sampled_from([np.dtype("<f4"), np.dtype(">f8")]),
       st.one_of(hnp.array_shapes(min_dims=0, max_dims=1, min_side=0, max_side=8),
                 hnp.array_shapes(min_dims=4, max_dims=5, min_side=1, max_side=3),
                 hnp.array_shapes(min_dims=2, max_dims=3, min_side=0, max_side=4).filter(lambda s: 0 in s)))
def test_unsupported_shape_is_refused_in_one_line(dtype, shape):
    with tempfile.TemporaryDirectory() as tmp:
        path = _save_npy(np.zeros(shape, dtype=dtype), Path(tmp))
        with pytest.raises(FFNQuantError) as info:
            load_tokens(path)
    one_line(info.value)


@SETTINGS
@given(float_arrays(), st.sampled_from([np.nan, np.inf, -np.inf]), st.data())
def test_non_finite_values_are_refused_in_one_line(array, bad, data):
    flat = array.reshape(-1)
    flat[data.draw(st.integers(0, flat.size - 1))] = bad
    with tempfile.TemporaryDirectory() as tmp:
        path = _save_npy(array, Path(tmp))
        with pytest.raises(FFNQuantError) as info:
            load_tokens(path)
    one_line(info.value)


@SETTINGS
@given(float_arrays(), st.integers(1, 64))
def test_wrong_d_model_is_refused_in_one_line(array, d_model):
    assume(d_model != array.shape[-1])
    with tempfile.TemporaryDirectory() as tmp:
        path = _save_npy(array, Path(tmp))
        with pytest.raises(FFNQuantError) as info:
            load_tokens(path, d_model=d_model)
    one_line(info.value)


def test_object_array_is_refused_in_one_line(tmp_path):
    path = _save_npy(np.array([[{"a": 1}, None]], dtype=object), tmp_path, allow_pickle=True)
    with pytest.raises(FFNQuantError) as info:
        load_tokens(path)
    one_line(info.value)


@st.composite
def corrupted(draw) -> tuple[str, bytes]:
    """A valid token file's bytes, truncated, overwritten in places, or extended; or bytes from nowhere."""
    suffix = draw(st.sampled_from([".npy", ".safetensors"]))
    array = draw(float_arrays())
    buf = io.BytesIO()
    if suffix == ".npy":
        np.save(buf, array)
    else:
        from safetensors.numpy import save

        buf.write(save({"acts": np.ascontiguousarray(array.astype(array.dtype.newbyteorder("<")))}))
    data = bytearray(buf.getvalue())
    how = draw(st.sampled_from(["truncate", "overwrite", "extend", "random"]))
    if how == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif how == "overwrite":
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, min(len(data) - 1, 160)))  # mostly the header
            data[i] = draw(st.integers(0, 255))
    elif how == "extend":
        data += draw(st.binary(min_size=1, max_size=64))
    else:
        data = bytearray(draw(st.binary(max_size=256)))
    return suffix, bytes(data)


@settings(max_examples=100, deadline=None)
@given(corrupted())
def test_corrupt_token_file_loads_or_is_refused_in_one_line(case):
    suffix, data = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"tokens{suffix}"
        path.write_bytes(data)
        try:
            got = load_tokens(path)
        except FFNQuantError as exc:
            one_line(exc)
            return
    assert got.dtype == torch.float32 and got.ndim == 2 and bool(torch.isfinite(got).all())
