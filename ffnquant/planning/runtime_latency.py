"""The latency table on a torch-module runtime (torch's kernels, ffnquant's Triton kernels, bitsandbytes; CPU or
CUDA), for a plan served there rather than by onnxruntime: `plan --objective latency --runtime torch-cuda-graph`.

Each candidate recipe is timed as the runtime's kernel for its scheme (`runtime_format`), on one layer's float
FFN at the model's shape, for the plan's request (a prefill of the prompt, then one-token decode steps), in
interleaved rounds like the onnxruntime table (`latency_table`), with the runtime's own timer (CUDA events on a
GPU, wall time with synchronisation on a CPU). Remedies that fold into the weights or the preceding norm
(smooth, AWQ, a calibrator) run the scheme's kernel, so recipes sharing a kernel share one measurement; a recipe
the runtime has no kernel for (a static uint8 scheme, an online rotation, a site kept in float) gets the reason
and a latency objective cannot choose it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..errors import FFNQuantError, first_line
from ..measure.timing import default_timer, time_calls
from ..recipe import Recipe
from ..runtimes import ModelCase, Runtime, get_runtime
from .latency_table import request_row
from .target import Workload

__all__ = ["check_runtimes", "runtime_format", "measure_runtime_table"]

# one-token calls are short: more of them per round for a median as steady as the prefill's
DECODE_CALLS = 10


def check_runtimes(names: Sequence[str]) -> list[Runtime]:
    """The runtimes called `names`, each available here; else one error naming the first that is not and why."""
    out = []
    for name in names:
        if name == "vllm-cpu":  # not a module runtime: its table is measured in vLLM (`planning.vllm_latency`)
            from ..deploy.vllm import vllm_unavailable

            why = vllm_unavailable()
            if why is not None:
                raise FFNQuantError(f"plan runtime {name} is not available here: {why}")
            continue
        if name == "genai-cpu":  # nor this one: its table is measured in genai's loop (`planning.genai_latency`)
            from ..deploy.genai import genai_unavailable

            why = genai_unavailable()
            if why is not None:
                raise FFNQuantError(f"plan runtime {name} is not available here: {why}")
            continue
        runtime = get_runtime(name)
        avail = runtime.availability()
        if not avail.available:
            raise FFNQuantError(f"plan runtime {name} is not available here: {avail.reason}")
        out.append(runtime)
    return out


def runtime_format(recipe: Recipe, runtime: Runtime) -> tuple[str | None, str]:
    """(the runtime format whose kernel serves `recipe`, a note) or (None, why the runtime cannot serve it): the
    runtime's own answer (`Runtime.serves`, what `backends.supports(runtime.name, recipe)` asks too), from the
    very adapter the table times."""
    return Runtime.serves(runtime, recipe)  # it reads only the runtime's name, device and formats


def measure_runtime_table(layer: Any, recipes: Sequence[Recipe], runtimes: Sequence[Runtime], workload: Workload,
                          rounds: int = 7, per_round: int = 3,
                          progress: Callable[[str, int, int], None] | None = None) -> dict[str, dict[str, Any]]:
    """{recipe text: `latency_table.request_row` + {runtime, kernel, note}, or {reason}} for one layer's shape."""
    table: dict[str, dict[str, Any]] = {}
    loads: dict[tuple[str, str], tuple[Runtime, Any]] = {}  # (runtime, format) -> one load shared by its recipes
    failed: dict[tuple[str, str], str] = {}
    keys: dict[str, tuple[str, str]] = {}
    for n, recipe in enumerate(recipes, 1):
        key, reasons = str(recipe), []
        for runtime in runtimes:  # the first runtime with a kernel that loads for this shape serves the recipe
            fmt, note = runtime_format(recipe, runtime)
            if fmt is None:
                reasons.append(note)
                continue
            lk = (runtime.name, fmt)
            if lk not in loads and lk not in failed:
                try:
                    case = ModelCase(spec=layer.spec, scheme=fmt, model=layer.ffn, max_tokens=workload.prompt)
                    loads[lk] = (runtime, runtime.load(case))
                except Exception as exc:  # a shape the kernel refuses, a kernel failing here: that is the answer
                    failed[lk] = f"{runtime.name} {fmt}: {first_line(exc)}"
            if lk in failed:
                reasons.append(failed[lk])
                continue
            keys[key] = lk
            table[key] = {"runtime": runtime.name, "kernel": loads[lk][1].label, "note": note}
            break
        else:
            table[key] = {"reason": "; ".join(reasons)}
        if progress is not None:
            progress(f"latency table: load {key}", n, len(recipes))
    rng = np.random.default_rng(0)
    sizes = {"prefill": (workload.prompt, per_round), "decode": (1, per_round * DECODE_CALLS if workload.decode else 0)}
    inputs = {k: rng.standard_normal((1, n, layer.spec.d_model)).astype(np.float32) for k, (n, _) in sizes.items()}
    times: dict[tuple[tuple[str, str], str], list[float]] = {(lk, k): [] for lk in loads for k in sizes}
    try:
        prepared = {(lk, k): rt.prepare(loaded, inputs[k]) for lk, (rt, loaded) in loads.items() for k in sizes}
        timers = {lk: default_timer(rt, loaded) for lk, (rt, loaded) in loads.items()}
        for (lk, k), p in prepared.items():  # warm-up: first calls compile, tune and allocate
            rt, loaded = loads[lk]
            time_calls(lambda: rt.run(loaded, p), 0, warmup=3)
            rt.synchronize(loaded)
        for r in range(rounds):
            for lk, (rt, loaded) in loads.items():
                for k, (_, calls) in sizes.items():
                    call = lambda: rt.run(loaded, prepared[lk, k])  # noqa: E731
                    times[lk, k] += [1e3 * t for t in time_calls(call, calls, timer=timers[lk])]
            if progress is not None:
                progress("latency table: timing rounds", r + 1, rounds)
    finally:
        prepared = {}
        for rt, loaded in loads.values():
            rt.release(loaded)
    for key, lk in keys.items():
        table[key].update(request_row(times[lk, "prefill"], times[lk, "decode"] or [0.0], workload))
    return table

