"""Each candidate recipe's FFN latency at the model's real shape, measured on its ONNX artifact, for the request
the plan is made for (`target.Workload`): a prefill of the prompt (one call on `prompt` tokens) and decode steps
(one call on one token each), the request's time = prefill + decode x step.

All layers of a model share one FFN shape, so one layer's artifacts give the table (latency does not depend
on the weights' values). Cases are timed in interleaved rounds (every recipe at both sizes once per round) so
that the machine's drift spreads over all of them alike: the plan compares sums of these times, so ratios
measured side by side are what matter. A recipe without an onnxruntime artifact has no time and says why; a
latency objective cannot choose it. A recipe slower than fp32 on the request is never chosen: fp32 predicts no
damage, so the search's Pareto front drops anything that costs more (`search.pareto`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..infra.atomic import ScratchFolder
from ..measure.timing import time_calls
from ..onnx import onnxquant as OQ
from ..quantization import quantize_recipes
from ..recipe import Recipe
from .target import Workload

__all__ = ["measure_latency_table", "request_row"]

# one-token calls are short: more of them per round for a median as steady as the prefill's
DECODE_CALLS = 10


def request_row(prefill_ms: Sequence[float], decode_ms: Sequence[float], workload: Workload) -> dict[str, Any]:
    """A table row from a recipe's prefill and decode-step times (ms): each one's p10/p50/p90 and the request's
    (`p50_ms`, what the search minimises: `workload.cost` of the two medians; p10/p90 likewise)."""
    pre = {q: float(np.percentile(prefill_ms, q)) for q in (10, 50, 90)}
    dec = {q: float(np.percentile(decode_ms, q)) for q in (10, 50, 90)}
    return {**{f"p{q}_ms": workload.cost(pre[q], dec[q]) for q in (10, 50, 90)},
            "prefill_ms": pre[50], "prefill_p10_ms": pre[10], "prefill_p90_ms": pre[90],
            "decode_ms": dec[50], "decode_p10_ms": dec[10], "decode_p90_ms": dec[90],
            "samples": len(prefill_ms), "decode_samples": len(decode_ms),
            "tokens": workload.prompt, "decode_steps": workload.decode}


def measure_latency_table(layer: Any, recipes: Sequence[Recipe], calib: torch.Tensor, held_out: torch.Tensor,
                          tokens: Workload | int = Workload(), rounds: int = 7, per_round: int = 3,
                          progress: Callable[[str, int, int], None] | None = None) -> dict[str, dict[str, Any]]:
    """{recipe text: `request_row` + {kind, provider, onnx_sqnr_db}, or {reason}} for one layer's shape; `tokens`:
    the request (an int: that prompt with the default decode steps, as `Objective` reads it)."""
    workload = tokens if isinstance(tokens, Workload) else Workload(tokens)

    table: dict[str, dict[str, Any]] = {}
    sessions: dict[str, Any] = {}
    with ScratchFolder("plan-latency") as folder:  # marked: a killed run's is swept by the next run
        outcomes = quantize_recipes(layer.spec, recipes, collect_errors=True, onnx=True, baseline=False,
                                    sensitivity=False, out_artifacts=folder, model=layer.ffn, calib_tokens=calib,
                                    eval_tokens=held_out, name=layer.label)
        for n, outcome in enumerate(outcomes, 1):
            key = str(outcome.recipe)
            if not outcome.ok:
                table[key] = {"reason": str(outcome.error).splitlines()[0]}
                continue
            art = outcome.result.artifact
            if not art.get("path"):
                table[key] = {"reason": art.get("note") or "no onnxruntime artifact"}
                continue
            session = OQ.ort_session(art["path"])
            sessions[key] = session
            table[key] = {"kind": art.get("kind"), "provider": session.get_providers()[0],
                          "onnx_sqnr_db": (art.get("accuracy_onnx") or {}).get("sqnr_db")}
            if progress is not None:
                progress(f"latency table: artifact {key}", n, len(recipes))
        rng = np.random.default_rng(0)
        sizes = {"prefill": (workload.prompt, per_round), "decode": (1, per_round * DECODE_CALLS if workload.decode else 0)}
        inputs = {k: rng.standard_normal((1, n, layer.spec.d_model)).astype(np.float32) for k, (n, _) in sizes.items()}
        times: dict[tuple[str, str], list[float]] = {(key, k): [] for key in sessions for k in sizes}
        for session in sessions.values():  # warm-up: first runs allocate and pick kernels
            for x in inputs.values():
                for _ in range(3):
                    session.run(None, {"input": x})
        for r in range(rounds):
            for key, session in sessions.items():
                for k, (_, calls) in sizes.items():
                    x = {"input": inputs[k]}
                    times[key, k] += [1e3 * t for t in time_calls(lambda: session.run(None, x), calls)]
            if progress is not None:
                progress("latency table: timing rounds", r + 1, rounds)
        del sessions
    for key, row in table.items():
        if (key, "prefill") in times:
            row.update(request_row(times[key, "prefill"], times[key, "decode"] or [0.0], workload))
    return table
