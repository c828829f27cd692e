"""Executors: the local one keeps input order and raises a task's own error; the registry's errors are one line;
with Ray installed, a local Ray instance of two worker processes runs a bench sweep and a tiny-model plan with
the same results as this process (skipped, with the reason, without Ray)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.measure.executor import EXECUTORS, INSTALL_HINT, LocalExecutor, get_executor

from hf_models import tiny_folders


# --- the local executor and the registry --------------------------------------------------------

@pytest.mark.parametrize("items", [[], [3], [5, -1, 4, 0, 2]], ids=["empty", "one", "several"])
def test_local_map_keeps_input_order(items):
    ex = LocalExecutor()
    assert ex.map(abs, items) == [abs(i) for i in items]
    assert list(ex.as_completed(abs, items)) == list(enumerate(abs(i) for i in items))
    assert ex.share([1, 2]).get() == [1, 2]


def test_local_runs_in_this_process_and_stops_at_the_first_error():
    ex = LocalExecutor()
    assert ex.in_process and set(ex.map(lambda _: os.getpid(), range(3))) == {os.getpid()}
    seen = []

    def task(x):
        seen.append(x)
        return int(x)

    with pytest.raises(ValueError, match="'x'"):  # the task's own exception, as the plain loop raised it
        ex.map(task, ["1", "x", "3"])
    assert seen == ["1", "x"]


@pytest.mark.parametrize("name, address, message", [
    ("dask", None, "unknown executor 'dask'; valid: local, ray"),
    ("local", "10.0.0.1:6379", "is for --executor ray"),
], ids=["unknown-name", "address-without-ray"])
def test_get_executor_refuses_in_one_line(name, address, message):
    with pytest.raises(FFNQuantError, match=message) as info:
        get_executor(name, address)
    assert "\n" not in str(info.value)
    assert set(EXECUTORS) == {"local", "ray"}


def test_ray_not_installed_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(FFNQuantError, match="not installed") as info:
        get_executor("ray")
    assert INSTALL_HINT in str(info.value) and "\n" not in str(info.value)


def test_cli_ray_address_with_the_local_executor_is_one_line(tmp_path, capsys):
    rc = main(["bench", "--d-model", "32", "--runtimes", "torch-cpu", "--schemes", "fp32", "--tokens", "1",
               "--ray-address", "10.0.0.1:6379", "--out", str(tmp_path / "r"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "is for --executor ray" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


# --- on a local Ray instance of two worker processes ---------------------------------------------

@pytest.fixture(scope="module")
def ray_executor():
    ray = pytest.importorskip("ray", reason=f"Ray not installed ({INSTALL_HINT})")
    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    import logging

    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    try:
        yield get_executor("ray")
    finally:
        ray.shutdown()


def test_ray_map_keeps_order_and_raises_the_tasks_own_error(ray_executor):
    assert not ray_executor.in_process
    assert ray_executor.map(abs, [5, -1, 4, 0, -2]) == [5, 1, 4, 0, 2]
    # the tasks ran in the worker processes (a lambda travels by value: a worker cannot import this test module)
    assert os.getpid() not in set(ray_executor.map(lambda _: os.getpid(), range(4)))
    assert ray_executor.share({"x": 1}).get() == {"x": 1}
    with pytest.raises(ValueError, match="'x'") as info:  # the worker's ValueError, not Ray's wrapper
        ray_executor.map(int, ["1", "x"])
    assert type(info.value) is ValueError
    described = ray_executor.describe()
    assert described["executor"] == "ray" and described["cpus"] == 2


def test_an_unreachable_ray_address_fails_at_once_in_one_line():
    pytest.importorskip("ray", reason=f"Ray not installed ({INSTALL_HINT})")
    with pytest.raises(FFNQuantError, match="cannot reach the Ray cluster at 127.0.0.1:1") as info:
        get_executor("ray", "127.0.0.1:1")  # nothing listens on port 1; Ray alone would retry for minutes
    assert "ray start --head" in str(info.value) and "\n" not in str(info.value)


# Everything a case measured except the timings, which no two runs share.
NUMERICS = ("variant", "spec_key", "runtime", "scheme", "tokens", "device", "host", "sqnr_db", "max_abs_error",
            "reference_sqnr_db", "sqnr_vs_reference_db", "reference_note", "weight_bytes", "file_bytes",
            "bytes_per_call", "flops_per_call", "label", "providers", "error")


def test_bench_cases_on_ray_match_the_local_sweep(ray_executor):
    from ffnquant.bench import BenchConfig, run_benchmark
    from ffnquant.spec import FFNSpec

    specs = [FFNSpec("swiglu", d_model=32)]
    config = BenchConfig(tokens=(1, 8), budget_s=0.01, warmup=1, min_repeats=2)
    # torch-cpu runs fp32 and dynamic int8, onnxruntime fp32, static int8 and 4-bit: the rest is listed as skipped
    schemes = ["fp32", "w8a8", "w8a8-dynamic-s8", "w4a16-g32"]
    local = run_benchmark(specs, ["torch-cpu", "ort-cpu"], schemes, config)
    seen = []
    remote = run_benchmark(specs, ["torch-cpu", "ort-cpu"], schemes, config, executor=ray_executor,
                           progress=lambda done, total, label: seen.append((done, total)))
    assert len(remote.cases) == len(local.cases) == (2 + 3) * 2 and len(remote.skipped) == 3
    assert [{k: c.to_dict()[k] for k in NUMERICS} for c in remote.cases] == \
           [{k: c.to_dict()[k] for k in NUMERICS} for c in local.cases]
    assert all(c.ok and c.host for c in remote.cases)  # each case names the host and the kernel that ran it
    assert remote.runtimes == local.runtimes and remote.skipped == local.skipped
    assert [d for d, _ in seen] == list(range(1, len(remote.cases) + 1)) and seen[-1][1] == len(remote.cases)
    assert remote.environment["executor"]["executor"] == "ray"


def test_cli_bench_on_ray_stamps_each_case_with_its_host(ray_executor, tmp_path, capsys):
    rc = main(["bench", "--variants", "relu", "--d-model", "32", "--runtimes", "ort-cpu", "--schemes", "fp32,w8a8",
               "--tokens", "1", "--budget-s", "0.01", "--min-repeats", "2", "--executor", "ray",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "latency.json").read_text())
    assert doc["environment"]["executor"]["executor"] == "ray" and "--executor ray" in doc["command"]
    for case in doc["cases"]:
        assert case["host"] and case["providers"] == ["CPUExecutionProvider"]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return tiny_folders(tmp_path_factory, ("llama",))["llama"][0]


@pytest.mark.hf
def test_plan_on_ray_is_the_local_plan(ray_executor, tiny_llama, monkeypatch):
    from ffnquant.hf import EvalSettings
    from ffnquant.planning.job import make_plan
    from ffnquant.planning.target import Objective

    # two remedy sets (plain, smooth) -> two tasks per layer; gptq and the probes need the plain preparation
    candidates = "fp32,w8a8@search,w8a8-dynamic-s8,w4a16-g32-gptq,w8a8@search+smooth"
    kw = dict(settings=EvalSettings(max_calib_tokens=256, max_eval_tokens=128, ablation=False), probe_tokens=128,
              ort_floor=False)
    plans = {}
    for name, executor in (("local", None), ("ray", ray_executor)):
        if name == "ray":  # the scoring must run in the workers, whose modules are their own
            monkeypatch.setattr("ffnquant.planning.candidates.score_layer", None)
        plan, result = make_plan(tiny_llama, "ppl+1%", Objective("bytes"), candidates, executor=executor, **kw)
        for volatile in ("timings", "executor"):
            result.pop(volatile)
        plans[name] = plan.to_toml(), json.dumps(result, default=str)
    assert plans["ray"][0] == plans["local"][0]  # the same plan.toml
    assert plans["ray"][1] == plans["local"][1]  # and every figure of plan.json, in the same order
