"""hf.draft: a draft model (Gemma 4's assistants) run from token ids through the model it drafts for.

The batched call must be, at every position, the drafting step transformers' assisted generation makes there
(`SinglePositionMultiTokenCandidateGenerator`, run here on each prefix): the same logits up to float32 rounding
(the attention sums the same keys in another batching), including past the sliding window, where the draft
model's window is its own (one position wider than the target's causal one)."""

from __future__ import annotations

import json

import pytest
import torch

from ffnquant.errors import FFNQuantError

pytestmark = pytest.mark.hf

T_ = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(assistant folder, target folder, a Llama folder) of tiny random-weight models, the word-level tokenizer."""
    from hf_models import DRAFT_TARGETS, save_causal_tiny, tokenizer

    T_.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("draft")
    tok = tokenizer(T_)
    return (save_causal_tiny(T_, "gemma4_assistant", root / "assistant", tok),
            save_causal_tiny(T_, DRAFT_TARGETS["gemma4_assistant"], root / "target", tok),
            save_causal_tiny(T_, "llama", root / "llama", tok))


def _drafting_steps(assistant, target, ids: torch.Tensor) -> torch.Tensor:
    """[batch, n, vocab]: the first drafted token's logits after each prefix ids[:, :t + 1], by transformers' own
    candidate generator, the target run on the prefix as generate() runs it."""
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    out = []
    for t in range(ids.shape[1]):
        prefix = ids[:, :t + 1]
        with torch.no_grad():
            states = target(input_ids=prefix, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
            generator = SinglePositionMultiTokenCandidateGenerator(
                assistant, target.get_input_embeddings(), GenerationConfig(max_length=ids.shape[1] + 8))
            generator.num_assistant_tokens = 1
            _, logits = generator.get_candidates(prefix, {"attention_mask": torch.ones_like(prefix)}, states,
                                                 is_first_iteration=False, n_last_matches=0)
        out.append(logits)
    return torch.cat(out, dim=1)


def test_the_batched_call_is_each_positions_drafting_step_past_the_sliding_window(pair):
    from ffnquant.hf import load_hf_model
    from ffnquant.hf.draft import is_fed, use_target

    assistant_dir, target_dir, _ = pair
    window = json.loads((assistant_dir / "config.json").read_text())["text_config"]["sliding_window"]
    ids = torch.randint(3, 90, (2, window + 8), generator=torch.Generator().manual_seed(0))
    with use_target(target_dir):
        assistant = load_hf_model(assistant_dir)
        assert is_fed(assistant)
        with torch.no_grad():
            batched = assistant(input_ids=ids, use_cache=False).logits
        target = assistant.forward.target.model(torch.device("cpu"), torch.float32)
        want = _drafting_steps(assistant, target, ids)
    assert batched.shape == want.shape
    # float32 rounding of the attention's sums in another batching: a few units in the last place of the logits
    scale = float(want.abs().max())
    assert torch.allclose(batched, want, rtol=0, atol=64 * 2.0 ** -24 * scale * ids.shape[1])
    # past the window the steps attend to window + 1 positions: a mask one narrower would move them
    assert torch.equal(batched.argmax(-1), want.argmax(-1))


def test_a_draft_model_without_its_target_is_refused_before_it_is_read(pair, monkeypatch):
    from ffnquant.hf import load_hf_model

    assistant_dir, _, _ = pair
    monkeypatch.setattr(T_.PreTrainedModel, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("the model was read before the refusal")))
    with pytest.raises(FFNQuantError, match=r"a draft model: its forward refuses token ids alone \(inputs_embeds and "
                                            r"shared_kv_states cannot be None.\).*--target-model PATH"):
        load_hf_model(assistant_dir)


@pytest.mark.parametrize("argv, message", [
    (["plan"], r"give that target model with --target-model PATH"),
    (["plan", "--target-model", "{nowhere}"], r"--target-model '.*nowhere': not a model folder \(no config.json"),
    (["plan", "--target-model", "{llama}"], r"--target-model '.*llama' \(LlamaForCausalLM\) returns no "
                                            r"shared_kv_states: it is not a model this draft model drafts for"),
], ids=["no-target", "not-a-folder", "not-a-target"])
def test_the_command_line_names_what_is_wrong_with_the_target(pair, tmp_path, capsys, argv, message):
    import re

    from ffnquant.cli import main

    assistant_dir, _, llama = pair
    argv = [a.format(nowhere=tmp_path / "nowhere", llama=llama) for a in argv]
    out = tmp_path / "plan"
    assert main([*argv, "--model", str(assistant_dir), "--calib-tokens", "128", "--eval-tokens", "128",
                 "--seq-len", "32", "--no-progress", "--out", str(out)]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_any_other_model_is_left_as_it_is(pair):
    from ffnquant.hf import load_hf_model
    from ffnquant.hf.draft import folder_draft_refusal, is_fed, use_target

    _, target_dir, llama = pair
    with use_target(target_dir):
        model = load_hf_model(llama)
    assert not is_fed(model) and "forward" not in model.__dict__
    assert folder_draft_refusal(llama) is None and folder_draft_refusal(target_dir) is None


def test_a_draft_model_plans_exports_and_is_proven_through_its_target(pair, tmp_path, capsys):
    """plan -> export compressed-tensors: proven (the loaded folder run through the target as the original was);
    generation is said to be its target's; the whole-model ONNX graph is refused with the reason."""
    from ffnquant.cli import main
    from ffnquant.deploy.onnx_model import graph_refusal
    from ffnquant.hf import inspect_model

    assistant_dir, target_dir, _ = pair
    common = ["--model", str(assistant_dir), "--target-model", str(target_dir), "--calib-tokens", "256",
              "--eval-tokens", "256", "--seq-len", "32", "--no-progress"]
    assert main(["plan", *common, "--target", "ppl+5%", "--objective", "bytes", "--candidates", "fp32,w4a16-g32",
                 "--probe-tokens", "64", "--out", str(tmp_path / "plan")]) == 0
    assert main(["export", *common, "--plan", str(tmp_path / "plan" / "plan.toml"), "--format", "compressed-tensors",
                 "--out", str(tmp_path / "ct")]) == 0
    doc = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["proven"], doc["proof"]["unproven"]
    assert "target decides every token" in doc["proof"]["generation"]["skipped"]
    assert "a draft model" in graph_refusal(inspect_model(assistant_dir))


def test_inspect_says_a_draft_model_runs_through_its_target(pair, capsys):
    from ffnquant.cli import main

    assistant_dir, _, llama = pair
    assert main(["model", "inspect", str(assistant_dir)]) == 0
    assert "draft model: runs through the model it drafts for; give that target with --target-model" in \
        capsys.readouterr().out
    assert main(["model", "inspect", str(llama)]) == 0
    assert "draft model" not in capsys.readouterr().out


def test_a_draft_model_whose_masks_are_built_otherwise_is_refused_by_name(pair, monkeypatch):
    from ffnquant.hf import load_hf_model
    from ffnquant.hf.draft import use_target

    assistant_dir, target_dir, _ = pair
    monkeypatch.delattr(T_.Gemma4AssistantForCausalLM, "create_attention_masks")
    with use_target(target_dir), pytest.raises(FFNQuantError, match=r"builds its attention masks otherwise than "
                                                                    r"transformers' Gemma 4 assistants"):
        load_hf_model(assistant_dir)


@pytest.mark.parametrize("target", ["missing", "none"], ids=["not-a-folder", "no-target"])
def test_the_python_api_takes_the_target_and_checks_it_first(pair, tmp_path, target):
    import ffnquant

    assistant_dir, _, _ = pair
    given = tmp_path / "nowhere" if target == "missing" else None
    want = r"not a model folder" if target == "missing" else r"give that target model .*target_model= in the Python API"
    for call in (lambda: ffnquant.plan(assistant_dir, "ppl+5%", objective="bytes", progress=False, target_model=given),
                 lambda: ffnquant.apply(assistant_dir, "w8a16", progress=False, target_model=given)):
        with pytest.raises(FFNQuantError, match=want):
            call()


def test_the_memory_plan_counts_the_target_and_the_states_it_keeps(pair):
    from ffnquant.hf import inspect_model
    from ffnquant.hf.draft import _TargetStates, target_bytes, use_target

    _, target_dir, _ = pair
    assert target_bytes(512) == 0  # no target set
    width = json.loads((target_dir / "config.json").read_text())["hidden_size"]
    with use_target(target_dir):
        assert target_bytes(0) == 4 * inspect_model(target_dir).n_params_total
        assert target_bytes(512) - target_bytes(0) == _TargetStates._KEEP * 6 * 512 * width * 4
