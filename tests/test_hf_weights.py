"""`hf.weights`: a folder's tensors read under the names transformers loads them as, converted as it converts them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
save_file = pytest.importorskip("safetensors.torch").save_file

EXPERTS = "model.llm.layers.0.mlp.experts"  # stored so; transformers loads it as model.layers.0.mlp.experts
LOADED = "model.layers.0.mlp.experts"


def _nvfp4(gen: torch.Generator, experts: int, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """One NVFP4 expert tensor as Inkling 2 Loop's original checkpoints store it: two E2M1 codes a byte, a float8
    scale per 16 values, a per-expert amax and denominator."""
    return {"w13_weight": torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, dtype=torch.uint8),
            "w13_weight_scale": (torch.rand(experts, rows, cols // 16, generator=gen) + 0.5).to(torch.float8_e4m3fn),
            "w13_weight_amax": torch.rand(experts, generator=gen) + 1.0,
            "w13_weight_outer_scale_denominator": torch.full((experts,), 448.0 * 6.0)}


@pytest.mark.parametrize("stored", ["weight-and-scales", "weight-alone"])
def test_a_tensor_transformers_dequantizes_from_several_stored_ones_is_read_as_it_loads_it(tmp_path, stored):
    """Inkling 2 Loop's experts: gate_up_proj is made from w13_weight and its scales (NVFP4), de-quantized and
    interleaved by transformers' own operations; read with every stored companion, the values and shape are
    transformers' (twice the stored columns); a folder holding the weight alone (as transformers saves it) passes
    it through."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from ffnquant.hf.weights import _Weights

    gen = torch.Generator().manual_seed(0)
    parts = _nvfp4(gen, 2, 8, 32)
    if stored == "weight-alone":
        parts = {"w13_weight": torch.randn(2, 8, 32, generator=gen)}
    save_file({f"{EXPERTS}.{k}": v for k, v in parts.items()}, str(tmp_path / "model.safetensors"))
    weights = _Weights(tmp_path, False)
    assert weights.rename_as_loaded("inkling2_loop_text")
    name = f"{LOADED}.gate_up_proj"
    got = weights.get(name)
    (conv,) = [c for c in get_checkpoint_conversion_mapping("inkling2_loop_text")
               if type(c).__name__ == "WeightConverter" and "w13_weight" in str(c.source_patterns[0])]
    state = {p: [parts[p.rpartition("\\.")[2]]] for p in conv.source_patterns if p.rpartition("\\.")[2] in parts}
    for op in conv.operations:
        state = op.convert(state, source_patterns=list(conv.source_patterns), target_patterns=list(conv.target_patterns))
    want = next(iter(state.values()))
    want = want[0] if isinstance(want, list) else want
    assert torch.equal(got, want)
    # NVFP4: two codes a stored byte, [2, 8, 16] stored; loaded as transformers de-quantizes it, [2, 8, 32]
    assert weights.shape(name) == tuple(want.shape) == (2, 8, 32)
    assert weights._shapes[f"{EXPERTS}.w13_weight"] == ((2, 8, 32) if stored == "weight-alone" else (2, 8, 16))
    assert weights.has(name) and name in weights.names
