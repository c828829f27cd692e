"""benchmarks/plan_cost.py's own machinery: a step stopped at its limit, and the random-weight checkpoints built at
run time (what the GPU session plans at Llama-3-8B's shapes, here at the tiny shape)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import plan_cost  # noqa: E402


def test_a_step_past_its_limit_is_stopped_and_reported(tmp_path):
    cmd = [sys.executable, "-c", "import time; print('stage one', flush=True); time.sleep(30)"]
    step = plan_cost.run_step("slow", cmd, {}, tmp_path / "slow.log", limit_s=2.0)
    assert step["rc"] == 124 and step["seconds"] < 20
    # each line carries its elapsed seconds: where a stopped step had got to
    assert any(line.endswith("stage one") and line.startswith("[") for line in step["tail"])


def test_a_step_within_its_limit_keeps_its_exit_code(tmp_path):
    step = plan_cost.run_step("quick", [sys.executable, "-c", "raise SystemExit(3)"], {}, tmp_path / "q.log",
                              limit_s=60.0)
    assert step["rc"] == 3


def test_a_sampled_step_runs_its_module_and_writes_its_stacks(tmp_path):
    (tmp_path / "slowmod.py").write_text("import sys, time\ntime.sleep(1.5)\nraise SystemExit(len(sys.argv))\n")
    cmd = plan_cost.sampled([sys.executable, "-m", "slowmod", "a", "b"], 0.3, tmp_path / "run.stacks")
    step = plan_cost.run_step("sampled", cmd, {"PYTHONPATH": str(tmp_path)}, tmp_path / "s.log", limit_s=60.0)
    assert step["rc"] == 3  # the module ran as __main__ with its own arguments
    stacks = (tmp_path / "run.stacks").read_text()
    assert stacks.startswith("--- ") and "slowmod.py" in stacks and "time.sleep" in stacks


def test_what_a_step_logs_names_no_path_of_this_machine(tmp_path, monkeypatch):
    monkeypatch.setattr(plan_cost, "_OUT", [str(tmp_path)])
    code = f"import sys; print(sys.prefix + '/lib/x.py', {str(tmp_path)!r} + '/plan/plan.toml', {str(plan_cost.REPO)!r} + '/ffnquant/cli.py')"
    plan_cost.run_step("paths", [sys.executable, "-c", code], {}, tmp_path / "p.log", limit_s=60.0)
    line = (tmp_path / "p.log").read_text().split("] ", 1)[1].strip()
    assert line == "<python>/lib/x.py OUT/plan/plan.toml ffnquant/cli.py"


@pytest.mark.parametrize("name", ["tiny", "llama3-8b"])
def test_random_models_have_the_shapes_they_name(name):
    shape = plan_cost.RANDOM_MODELS[name]
    assert shape["d"] % shape["heads"] == 0 and shape["heads"] % shape["kv_heads"] == 0
    assert shape["layers"] % shape["layers_per_shard"] == 0 and (shape["layers"] // 2) % shape["layers_per_shard"] == 0


def test_the_tiny_random_model_is_a_checkpoint_transformers_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder, seconds = plan_cost.random_model("tiny", tmp_path, "cpu")
    shape = plan_cost.RANDOM_MODELS["tiny"]
    config = json.loads((Path(folder) / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        shape["layers"], shape["d"], shape["f"])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = transformers.AutoTokenizer.from_pretrained(folder)("the cat sat", return_tensors="pt").input_ids
    assert model(ids).logits.shape[-1] == shape["vocab"] and seconds >= 0


def test_pairs_are_rendered_with_their_median_ratio():
    """More than one plan/peer pair: each pair's ratio in a table and the median of them (an even count: the mean of
    the middle two)."""
    pairs = [{"plan_s": 100.0, "peer_s": 200.0, "first": "plan", "verified": True},
             {"plan_s": 150.0, "peer_s": 100.0, "first": "peer", "verified": True},
             {"plan_s": 90.0, "peer_s": 100.0, "first": "plan", "verified": None},
             {"plan_s": 100.0, "peer_s": 100.0, "first": "peer", "verified": False}]
    text = "\n".join(plan_cost._pair_lines(pairs))
    assert "| 2 | peer | 150 s | 100 s | 1.50x | yes |" in text and "| 4 | peer | 100 s | 100 s | 1.00x | NO |" in text
    assert "Median of the 4 pairs' ratios: **0.95x** (range 0.50x..1.50x)" in text
    assert plan_cost._pair_lines(pairs[:1]) == []
