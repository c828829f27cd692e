"""deploy.ctensors.packed_beside_inputs: a plan whose folder transformers could only load decompressed while it
quantizes inputs is refused before anything is written.

BLT's weight initialisation reads `.weight` of every Linear, which compressed-tensors' packed 4-bit layout replaces
by `weight_packed`: transformers loads such a folder only decompressed, and decompressed Linears compute on float
inputs. A plan mixing 4-bit layers with layers that quantize their inputs would end NOT PROVEN after the whole
export; it is refused in one line instead, naming the layers, while each kind alone stays writable.
"""

from __future__ import annotations

import pytest

from ffnquant.cli import main
from ffnquant.planning.planfile import Plan, model_fingerprint
from ffnquant.recipe import Recipe

pytestmark = pytest.mark.hf
pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

TOKENS = ["--calib-tokens", "256", "--eval-tokens", "128", "--seq-len", "128"]


@pytest.fixture(scope="module")
def blt(tmp_path_factory):
    from hf_models import tiny_or_skip

    from ffnquant.hf import inspect_model

    folder = tiny_or_skip("blt", tmp_path_factory.mktemp("blt") / "blt")
    return folder, inspect_model(folder)


def _plan(info, recipes):
    return Plan(model_fingerprint(info), {i: Recipe.parse(r) for i, r in enumerate(recipes)}, "ppl+5%", "bytes")


@pytest.mark.parametrize("recipes, refused", [
    (["w8a8-dynamic-s8", "w4a16-g32"], True),
    (["w4a16-g32", "w4a16-g32"], False),
    (["w8a8-dynamic-s8", "w8a8-dynamic-s8"], False),
    (["fp32", "w4a16-g32"], False),
], ids=["4-bit-beside-per-token-int8", "4-bit-alone", "int8-alone", "4-bit-beside-float"])
def test_only_the_mix_is_refused(blt, recipes, refused):
    from ffnquant.deploy.ctensors import plan_refusal

    _, info = blt
    why = plan_refusal(_plan(info, recipes), info)
    assert (why is not None) == refused
    if refused:
        assert "BltForCausalLM._init_weights) reads .weight of every Linear" in why and "of L0 beside" in why


def test_the_export_refuses_the_mix_before_writing(blt, tmp_path, capsys):
    folder, info = blt
    plan = tmp_path / "plan.toml"
    plan.write_text(_plan(info, ["w8a8-dynamic-s8", "w4a16-g32"]).to_toml())
    out = tmp_path / "ct"
    assert main(["export", "--model", str(folder), "--plan", str(plan), "--format", "compressed-tensors", *TOKENS,
                 "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "loads in transformers only decompressed" in err
    assert not out.exists() and not (tmp_path / "ct.not-proven").exists()
