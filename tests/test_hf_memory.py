"""hf.memory's export check: a model whose export (held whole in memory) is estimated not to fit is refused in one
line before it is read, by the command and the Python API, and nothing is written."""

from __future__ import annotations

import pytest

import ffnquant
from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.hf import inspect_model
from ffnquant.hf import memory
from hf_models import one_recipe_plan, tiny_or_skip, write_llama_like


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense") / "m"
    write_llama_like(folder)
    return folder, one_recipe_plan(folder, "w8a16", folder.parent / "plan.toml")


@pytest.fixture
def no_runtime(monkeypatch):
    """The estimate of the model alone: no process memory, no runtime allowance."""
    monkeypatch.setattr(memory, "process_rss", lambda: 0)
    monkeypatch.setattr(memory, "_RUNTIME_BYTES", 0)


def test_the_estimate_is_the_measured_factor_of_the_float32_model(dense, no_runtime):
    info = inspect_model(dense[0])
    assert memory.export_peak(info) == memory._EXPORT_MODEL_FACTOR * 4 * info.n_params_total


def test_routed_experts_add_their_own_copies(tmp_path, no_runtime):
    info = inspect_model(tiny_or_skip("qwen3_moe", tmp_path / "moe"))
    experts = [layer for layer in info.layers if layer.expert is not None]
    assert experts
    extra = memory._EXPORT_EXPERTS_FACTOR * 4 * info.spec.n_params * len(experts)
    assert memory.export_peak(info) == memory._EXPORT_MODEL_FACTOR * 4 * info.n_params_total + extra


@pytest.mark.parametrize("budget, refused", [(10**3, True), (10**12, False)], ids=["too-small", "room"])
def test_the_refusal_names_the_estimate_and_the_budget(dense, budget, refused):
    why = memory.export_memory_refusal(inspect_model(dense[0]), budget)
    assert (why is not None) == refused
    if refused:
        assert "export holds the whole model in memory" in why and "--max-memory" in why and "\n" not in why
        assert "more than the 1.0 kB --max-memory" in why, why


def test_the_command_refuses_before_reading_and_writes_nothing(dense, tmp_path, capsys):
    folder, plan = dense
    out = tmp_path / "out"
    rc = main(["export", "--model", str(folder), "--plan", str(plan), "--format", "compressed-tensors",
               "--max-memory", "1MB", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "export holds the whole model in memory" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_variant_exports_refuse_the_option(tmp_path, capsys):
    assert main(["export", "--max-memory", "8GB", "--out", str(tmp_path / "x")]) == 2
    assert "--max-memory is an option" in capsys.readouterr().err


def test_the_api_refuses_before_reading(dense):
    with pytest.raises(FFNQuantError, match="export holds the whole model in memory"):
        ffnquant.apply(dense[0], "w8a16", max_memory="1MB")
    with pytest.raises(FFNQuantError, match="max_memory"):
        ffnquant.apply(dense[0], "w8a16", max_memory="lots")


def test_the_benchmark_refuses_an_unknown_model_naming_the_valid_ones(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "export_memory.py"
    spec = importlib.util.spec_from_file_location("export_memory", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--models", "gpt-9", "--out", str(tmp_path / "x")]) == 2
    assert "unknown model(s) gpt-9; valid: llama-d2048-8L" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
