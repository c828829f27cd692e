"""ffnquant.hf.inputs: the model's learned positions bound every window and prompt the tool feeds it."""

from __future__ import annotations

import pytest

from ffnquant.hf.inputs import EvalSettings, fit_settings, position_limit


@pytest.mark.parametrize("config, want", [
    ({"max_position_embeddings": 2048}, 2048),
    ({"n_positions": 1024}, 1024),  # GPT-2
    ({"max_target_positions": 448, "max_source_positions": 1500}, 448),  # Whisper's decoder: its own positions
    ({"max_position_embeddings": 4096, "n_positions": 512}, 512),  # the least of those given
    ({"max_position_embeddings": True}, None),  # not a count
    ({"max_position_embeddings": 1}, None),
    ({}, None),  # ALiBi's BLOOM: no table to run past
], ids=["llama", "gpt2", "whisper-decoder", "least", "bool", "one", "none"])
def test_the_position_limit_is_the_least_count_of_learned_positions(config, want):
    assert position_limit(config) == want


def test_windows_are_cut_to_the_position_limit():
    class Info:  # fit_settings reads the config.json mapping only
        config = {"max_target_positions": 448}

    assert fit_settings(Info(), EvalSettings(seq_len=512)).seq_len == 448
    assert fit_settings(Info(), EvalSettings(seq_len=256)).seq_len == 256


def test_experts_the_router_sent_nothing_share_their_layers_routed_inputs_once():
    """Unrouted experts take their layer's routed experts' rows, never another unrouted one's (which would double
    the rows per such expert: 2^25 copies in a 32-expert layer), one tensor shared among them."""
    from types import SimpleNamespace

    import torch

    from ffnquant.errors import FFNQuantError
    from ffnquant.hf.inputs import _fill_unrouted

    def layer(index, expert):
        return SimpleNamespace(index=index, expert=expert, label=f"L{index}.e{expert}", name=f"m.{index}.{expert}")

    layers = [layer(0, e) for e in range(6)] + [layer(1, 0)]
    rows = {"L0.e0": torch.ones(3, 4), "L0.e1": torch.full((2, 4), 2.0), "L1.e0": torch.ones(5, 4)}
    inputs = {lay.label: rows.get(lay.label, torch.zeros(0, 4)) for lay in layers}
    borrowed: dict[str, str] = {}
    _fill_unrouted(layers, inputs, "calibration", borrowed)
    assert sorted(borrowed) == [f"L0.e{e}" for e in range(2, 6)]
    assert all(inputs[f"L0.e{e}"].shape == (5, 4) for e in range(2, 6))  # 3 + 2 rows, however many are unrouted
    assert len({inputs[f"L0.e{e}"].data_ptr() for e in range(2, 6)}) == 1
    with pytest.raises(FFNQuantError, match="L2.e0 .* received no evaluation tokens"):
        _fill_unrouted([layer(2, 0), layer(2, 1)], {"L2.e0": torch.zeros(0, 4), "L2.e1": torch.zeros(0, 4)},
                       "evaluation", {})
