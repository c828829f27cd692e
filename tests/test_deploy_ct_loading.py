"""deploy.ct_loading: transformers' loader as ffnquant's compressed-tensors folders need it.

HRM stores its attention as one gqkv_proj that transformers chunks into four as it loads, and it is a looped depth
(its L stack called six times: each call one of ffnquant's layers, a later call's FFN its first call's). With a
quantization config, transformers adds its dequantization to that float converter and refuses to build it; inside
`transformers_loading` the converter stays as the model's mapping writes it, and the folder is proven.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.hf
pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

@pytest.mark.parametrize("sources, expected", [
    (["mlp.experts.*.gate_proj.weight"], True),  # experts merged at load: transformers' own handling stays
    ([r"mlp\.gate_proj\.weight"], True),  # collects a weight the folder stores quantized
    ([r"attn\.gqkv_proj\.weight"], False),  # a float tensor only
    ([], True),
], ids=["wildcard", "quantized", "float", "no-sources"])
def test_a_converter_keeps_transformers_dequantization_only_where_it_collects_a_quantized_weight(sources, expected):
    from ffnquant.deploy.ct_loading import _collects_quantized

    converter = SimpleNamespace(_original_source_patterns=sources)
    assert _collects_quantized(converter, {"model.layers.0.mlp.gate_proj.weight"}) is expected


def test_a_looped_model_whose_float_tensors_transformers_converts_is_proven_loaded_inside_transformers_loading(
        tmp_path, capsys):
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer

    from ffnquant.deploy import transformers_loading
    from ffnquant.hf import inspect_model
    from hf_models import export_one_recipe, tiny_or_skip

    T.logging.set_verbosity_error()
    folder = tiny_or_skip("hrm_text", tmp_path / "hrm")
    info = inspect_model(folder)
    assert info.n_layers == 12 and info.shared_groups() == ((0, 2, 4, 6, 8, 10), (1, 3, 5, 7, 9, 11))
    out = tmp_path / "ct"
    assert export_one_recipe(folder, "w4a16-g32", out) == 0
    assert "load the folder inside `with ffnquant.deploy.transformers_loading(folder):`" in capsys.readouterr().out
    proof = json.loads((out / "ffnquant-deploy.json").read_text())["proof"]
    assert proof["proven"] and proof["weights"]["all_identical"] and proof["layers"]["all_at_parity"]
    assert any("gqkv_proj" in p for p in proof["load"]["float_converters_kept"])
    assert "transformers_loading(folder)" in (out / "ffnquant-deploy.md").read_text()
    with pytest.raises(ValueError, match="gqkv_proj"):  # transformers alone
        T.AutoModelForCausalLM.from_pretrained(str(out))
    with transformers_loading(out) as needed:
        T.AutoModelForCausalLM.from_pretrained(str(out))
    assert needed["per_expert"] == [] and any("gqkv_proj" in p for p in needed["float_converters"])
    assert "update_weight_conversions" not in vars(CompressedTensorsHfQuantizer)  # transformers' own, put back
