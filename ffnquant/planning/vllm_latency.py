"""The latency table in vLLM, for a plan served there: `plan --objective latency --runtime vllm-cpu`.

vLLM's kernels cannot be called one FFN at a time from this process (vLLM may live in another environment, and its
layers are built by its own loader), so the table is measured as vLLM serves a folder: the candidate recipes are
grouped by what vLLM computes for them (the scheme and any site kept in float: remedies such as smooth, AWQ, GPTQ or
a calibrator fold into the weights and run the same kernel), one representative recipe per group is given to some
of the model's own layers (round robin), the model is quantized that way and saved as compressed-tensors, vLLM loads
the folder once, and each FFN is timed on vLLM's own modules (`deploy.vllm.vllm_ffn_times`) at the request's prompt
(the prefill) and at one row (a decode step). A group's samples are those of its layers, at the model's shape. A
recipe vLLM's CPU build refuses gets the reason and is never chosen; the float FFN is timed in vLLM's dtype.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from ..deploy.vllm import vllm_cpu_decision, vllm_ffn_times, vllm_unavailable
from ..errors import FFNQuantError
from ..recipe import Recipe
from ..schemes import PRESETS, Method, get_scheme
from .latency_table import request_row
from .target import Workload

__all__ = ["VLLM_DTYPE", "kernel_groups", "kernel_scheme", "round_robin_model", "measure_vllm_table"]

VLLM_DTYPE = "bfloat16"  # what vLLM's CPU build computes in, and the only dtype of its 4-bit kernel
_LAYER = re.compile(r"\.layers\.(\d+)\.")


def kernel_groups(recipes: Sequence[Recipe], spec: Any) -> tuple[dict[str, list[Recipe]], dict[str, str]]:
    """({group: recipes} in first-seen order, {recipe: why vLLM's CPU build refuses it}); a group is the scheme plus
    any float site, named by its representative recipe (what vLLM computes the same way)."""
    groups: dict[str, list[Recipe]] = {}
    refused: dict[str, str] = {}
    for recipe in recipes:
        kernel, note = vllm_cpu_decision(recipe, spec)
        if kernel is None:
            refused[str(recipe)] = note
            continue
        rep = Recipe(kernel_scheme(recipe.scheme), keep_float=recipe.keep_float) if not recipe.is_float else recipe
        groups.setdefault(str(rep), []).append(recipe)
    return groups, refused


_STORED = ("weight_dtype", "weight_granularity", "group_size", "weight_symmetric", "act_dtype", "act_mode",
           "act_symmetric")


def kernel_scheme(name: str) -> str:
    """The round-to-nearest preset stored like scheme `name` (GPTQ's and AWQ's weights are stored and served like
    RTN's): what a folder timing its kernel needs, at a fraction of the quantization cost."""
    scheme = get_scheme(name)
    key = tuple(getattr(scheme, f) for f in _STORED)
    same = [p for p in PRESETS.values() if p.method is Method.RTN and tuple(getattr(p, f) for f in _STORED) == key]
    return name if not same or scheme.method is Method.RTN else min(same, key=lambda p: len(p.name)).name


def round_robin_model(info: Any, groups: Sequence[str], runtime: str, unit: str) -> tuple[dict[int, str], Any]:
    """({layer index: group}, the planned model): `info`'s model with each group's representative recipe on some of
    its layers, round robin, as the table of a serving `runtime` times it (`unit`: what a group is there)."""
    from ..deploy.planned import build_planned_model
    from .planfile import Plan, model_fingerprint

    layers = [layer.index for layer in info.layers]
    if len(layers) < len(groups):
        raise FFNQuantError(f"the {runtime} latency table times {len(groups)} {unit} on {len(layers)} FFN layers: a "
                            "layer each at least; plan with fewer candidates (--candidates)")
    assigned = {index: groups[k % len(groups)] for k, index in enumerate(layers)}
    plan = Plan(model_fingerprint(info), {i: Recipe.parse(g) for i, g in assigned.items()})
    # the weights' values do not change a kernel's time: few tokens calibrate the static scales, and what is written
    # (a scratch copy the runtime only times) goes without the deployment proof
    return assigned, build_planned_model(info, plan, calib_tokens=512, eval_tokens=256)


def _timing_folder(info: Any, groups: Sequence[str], folder: Path) -> dict[int, str]:
    """`info`'s model with each group's representative on some of its layers (round robin), saved as compressed-tensors
    in `folder`: {layer index: group}."""
    from ..deploy.ctensors import write_folder

    assigned, planned = round_robin_model(info, groups, "vLLM", "kernels")
    write_folder(planned, folder)
    return assigned


def measure_vllm_table(info: Any, recipes: Sequence[Recipe], workload: Workload = Workload(),
                       progress: Callable[[str, int, int], None] | None = None) -> dict[str, dict[str, Any]]:
    """{recipe text: `latency_table.request_row` + {runtime, kernel, note, layers}, or {reason}}: each candidate's
    FFN time in vLLM's CPU build at the model's shape, for `workload` (the module docstring's method)."""
    why = vllm_unavailable()
    if why is not None:
        raise FFNQuantError(f"plan runtime vllm-cpu is not available here: {why}")
    groups, refused = kernel_groups(recipes, info.spec)
    table: dict[str, dict[str, Any]] = {r: {"reason": note} for r, note in refused.items()}
    if not groups:
        return table
    names = list(groups)
    with tempfile.TemporaryDirectory(prefix="ffnquant-vllm-table-") as tmp:
        if progress:
            progress("latency table in vLLM: quantize and save the timing folder", 0, 2)
        assigned = _timing_folder(info, names, Path(tmp) / "folder")
        if progress:
            progress("latency table in vLLM: load and time each FFN", 1, 2)
        timed = vllm_ffn_times(Path(tmp) / "folder", [workload.prompt, 1], dtype=VLLM_DTYPE,
                               max_model_len=workload.prompt + 16)
    index_of = [int(m.group(1)) if (m := _LAYER.search("." + name)) else None for name in timed["modules"]]
    prefill, decode = timed["ms"][str(workload.prompt)], timed["ms"]["1"]
    for group in names:
        rows = [k for k, i in enumerate(index_of) if i is not None and assigned.get(i) == group]
        if not rows:
            for recipe in groups[group]:
                table[str(recipe)] = {"reason": f"vLLM named no FFN module of the layers given {group}"}
            continue
        row = request_row([x for k in rows for x in prefill[k]], [x for k in rows for x in decode[k]], workload)
        kernel, note = vllm_cpu_decision(groups[group][0], info.spec)
        for recipe in groups[group]:
            table[str(recipe)] = {**row, "runtime": "vllm-cpu", "kernel": kernel, "note": note, "timed_as": group,
                                  "layers": sorted(i for i, g in assigned.items() if g == group),
                                  "load_s": timed["load_s"], "kernels_logged": timed["kernels"]}
    if progress:
        progress("latency table in vLLM", 2, 2)
    return table
