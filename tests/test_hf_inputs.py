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
