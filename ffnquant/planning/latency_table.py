"""Each candidate recipe's FFN latency at the model's real shape, measured on its ONNX artifact, for the request
the plan is made for (`target.Workload`): a prefill of the prompt (one call on `prompt` tokens) and decode steps
(one call on one token each), the request's time = prefill + decode x step.

All layers of a model share one FFN shape, so one layer's artifacts give the table (latency does not depend
on the weights' values). Cases are timed in interleaved rounds (every recipe at both sizes once per round) so
that the machine's drift spreads over all of them alike: the plan compares sums of these times, so ratios
measured side by side are what matter. Recipes whose artifacts are the same graph (the same operators on the
same shapes and dtypes: `graph_signature`, e.g. a static int8 recipe with another calibrator) are timed once, so
that noise cannot rank identical kernels apart. A recipe without an onnxruntime artifact has no time and says why; a
latency objective cannot choose it. A recipe slower than fp32 on the request is never chosen: fp32 predicts no
damage, so the search's Pareto front drops anything that costs more (`search.pareto`); nor is one faster by less
than the table resolves (`rows.never_chosen`)."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..infra.atomic import ScratchFolder
from ..measure.timing import time_calls
from ..onnx import onnxquant as OQ
from ..quantization import quantize_recipes
from ..recipe import Recipe
from .candidates import held_rows
from .target import Workload

__all__ = ["measure_latency_table", "request_row"]

# one-token calls are short: more of them per round for a median as steady as the prefill's
DECODE_CALLS = 10
# The artifacts are made from a strided part of the layer's inputs: their time does not depend on the weights' or
# ranges' values, and their SQNR in the table is informative only (the candidates' own scoring reads every row).
TABLE_CALIB_ROWS = 1024
TABLE_HELD_ROWS = 256


def request_row(prefill_ms: Sequence[float], decode_ms: Sequence[float], workload: Workload) -> dict[str, Any]:
    """A table row from a recipe's prefill and decode-step times (ms): each one's p10/p50/p90 and the request's
    (`p50_ms`, what the search minimises: `workload.cost` of the two medians; p10/p90 likewise)."""
    pre = {q: float(np.percentile(prefill_ms, q)) for q in (10, 50, 90)}
    dec = {q: float(np.percentile(decode_ms, q)) for q in (10, 50, 90)}
    req = {q: workload.cost(pre[q], dec[q]) for q in (10, 50, 90)}
    # the median's standard error relative to it: sqrt(pi/2) sigma / sqrt(n), sigma from the p10-p90 span of a normal
    # (2 x 1.2816 sigma); what the plan's cost can resolve (`steering.min_gain`)
    rel_se = (math.sqrt(math.pi / 2) * (req[90] - req[10]) / 2.5631 / math.sqrt(len(prefill_ms)) / req[50]
              if req[50] > 0 and len(prefill_ms) else None)
    return {**{f"p{q}_ms": req[q] for q in (10, 50, 90)}, "median_rel_se": rel_se,
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
    same: dict[str, str] = {}  # recipe -> the recipe whose identical graph is timed for it
    by_graph: dict[tuple, str] = {}
    calib, held_out = held_rows(calib, TABLE_CALIB_ROWS), held_rows(held_out, TABLE_HELD_ROWS)
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
            graph = graph_signature(art["path"])
            if graph in by_graph:
                same[key] = by_graph[graph]
                table[key] = {"kind": art.get("kind"), "provider": table[by_graph[graph]]["provider"],
                              "timed_as": by_graph[graph]}
            else:
                by_graph[graph] = key
                session = OQ.ort_session(art["path"])
                sessions[key] = session
                table[key] = {"kind": art.get("kind"), "provider": session.get_providers()[0]}
            table[key].update(onnx_sqnr_db=(art.get("accuracy_onnx") or {}).get("sqnr_db"),
                              onnx_sqnr_rows=int(held_out.shape[0]))
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
        timed = same.get(key, key)
        if (timed, "prefill") in times:
            row.update(request_row(times[timed, "prefill"], times[timed, "decode"] or [0.0], workload))
    return table


def graph_signature(path: Any) -> tuple:
    """What an ONNX graph's run time depends on: its nodes' operators and attributes in order, and the dtypes and
    shapes of its inputs, outputs and initializers; not the weights' values, nor any name. Two artifacts with one
    signature run the same kernels on the same shapes."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path))
    g = model.graph

    def attr(a: Any) -> Any:
        value = helper.get_attribute_value(a)
        if isinstance(value, onnx.TensorProto):
            return ("tensor", value.data_type, tuple(value.dims))
        return (a.name, repr(value))

    def value_info(v: Any) -> tuple:
        t = v.type.tensor_type
        return (t.elem_type, tuple(d.dim_value or d.dim_param for d in t.shape.dim))

    return (tuple((n.domain, n.op_type, tuple(attr(a) for a in n.attribute)) for n in g.node),
            tuple(value_info(v) for v in g.input), tuple(value_info(v) for v in g.output),
            tuple(sorted((t.data_type, tuple(t.dims)) for t in g.initializer)))
