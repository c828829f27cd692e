"""Each candidate recipe's FFN latency at the model's real shape, measured on its ONNX artifact.

All layers of a model share one FFN shape, so one layer's artifacts give the table (latency does not depend
on the weights' values). Cases are timed in interleaved rounds (every recipe once per round) so that the
machine's drift spreads over all of them alike: the plan compares sums of these times, so ratios measured
side by side are what matter. A recipe without an onnxruntime artifact (per-token dynamic int8) has no time
and says why; a latency objective cannot choose it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..atomic import ScratchFolder
from ..recipe import Recipe

__all__ = ["measure_latency_table"]


def measure_latency_table(layer: Any, recipes: Sequence[Recipe], calib: torch.Tensor, held_out: torch.Tensor,
                          tokens: int = 512, rounds: int = 7, per_round: int = 3,
                          progress: Callable[[str, int, int], None] | None = None) -> dict[str, dict[str, Any]]:
    """{recipe text: {p50_ms, p10_ms, p90_ms, kind, provider, onnx_sqnr_db} or {reason}} for one layer's shape."""
    from .. import onnxquant as OQ
    from ..quantization import quantize_recipes

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
                          "onnx_sqnr_db": (art.get("accuracy_onnx") or {}).get("sqnr_db"), "times_ms": []}
            if progress is not None:
                progress(f"latency table: artifact {key}", n, len(recipes))
        x = np.random.default_rng(0).standard_normal((1, tokens, layer.spec.d_model)).astype(np.float32)
        for session in sessions.values():  # warm-up: first runs allocate and pick kernels
            for _ in range(3):
                session.run(None, {"input": x})
        for r in range(rounds):
            for key, session in sessions.items():
                for _ in range(per_round):
                    t0 = time.perf_counter()
                    session.run(None, {"input": x})
                    table[key]["times_ms"].append((time.perf_counter() - t0) * 1e3)
            if progress is not None:
                progress("latency table: timing rounds", r + 1, rounds)
        del sessions
    for row in table.values():
        times = row.pop("times_ms", None)
        if times:
            row.update(p10_ms=float(np.percentile(times, 10)), p50_ms=float(np.median(times)),
                       p90_ms=float(np.percentile(times, 90)), samples=len(times), tokens=tokens)
    return table
