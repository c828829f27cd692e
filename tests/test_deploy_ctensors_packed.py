"""deploy.ctensors.packed_beside_inputs: a plan whose folder transformers could only load decompressed while it
quantizes inputs is refused before anything is written.

BLT's weight initialisation reads `.weight` of every Linear, which compressed-tensors' packed 4-bit layout replaces
by `weight_packed`: transformers loads such a folder only decompressed, and decompressed Linears compute on float
inputs. A plan mixing 4-bit layers with layers that quantize their inputs would end NOT PROVEN after the whole
export; it is refused in one line instead, naming the layers, while each kind alone stays writable (the export's
refusal before writing: the architecture matrix's BLT row).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ffnquant.recipe import Recipe
from ffnquant.spec import FFNSpec, Variant

pytestmark = pytest.mark.hf
pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

@pytest.fixture(scope="module")
def blt(tmp_path_factory):
    """BLT's tiny config alone (its random weights are 384 MB): the refusal reads the model's class, not its weights."""
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    from hf_models import causal_config

    folder = tmp_path_factory.mktemp("blt")
    try:
        causal_config(T, "blt").save_pretrained(folder)
    except Exception as exc:  # noqa: BLE001 - a transformers without the type
        pytest.skip(f"blt not buildable here: {exc}")
    return SimpleNamespace(path=folder, model_type="blt", layers=(), spec=FFNSpec(Variant.SWIGLU, 32, 64))


def _plan(info, recipes):
    return SimpleNamespace(layers={i: Recipe.parse(r) for i, r in enumerate(recipes)})


@pytest.mark.parametrize("recipes, refused", [
    (["w8a8-dynamic-s8", "w4a16-g32"], True),
    (["w4a16-g32", "w4a16-g32"], False),
    (["w8a8-dynamic-s8", "w8a8-dynamic-s8"], False),
    (["fp32", "w4a16-g32"], False),
], ids=["4-bit-beside-per-token-int8", "4-bit-alone", "int8-alone", "4-bit-beside-float"])
def test_only_the_mix_is_refused(blt, recipes, refused):
    """The export's check before writing (`plan_refusal`, which the plan's deployment note reads too)."""
    from ffnquant.deploy.ctensors import plan_refusal

    why = plan_refusal(_plan(blt, recipes), blt)
    assert (why is not None) == refused
    if refused:
        assert "BltForCausalLM._init_weights) reads .weight of every Linear" in why and "of L0 beside" in why
        assert "only decompressed" in why and len(why.splitlines()) == 1


def test_a_model_whose_initialisation_takes_a_packed_linear_is_not_refused(tmp_path):
    """Llama's initialisation reads no `.weight` of a Linear it is handed loaded: the mix is written and proven
    there (tests/test_hf_matrix.py exports such mixes on every type it runs)."""
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    from hf_models import causal_config

    from ffnquant.deploy.ctensors import packed_beside_inputs

    causal_config(T, "llama").save_pretrained(tmp_path)
    info = SimpleNamespace(path=tmp_path, model_type="llama", layers=(), spec=FFNSpec(Variant.SWIGLU, 32, 64))
    assert packed_beside_inputs(_plan(info, ["w8a8-dynamic-s8", "w4a16-g32"]), info) is None
