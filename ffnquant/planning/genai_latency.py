"""The latency table in onnxruntime-genai, for a plan served there: `plan --objective latency --runtime genai-cpu`.

The table is measured as genai serves the model's ONNX decoder (`deploy.onnx_model`'s graph with its
`genai_config.json`): the candidate recipes are grouped by the graph they write (the stored scheme, any site kept in
float and a rotation: remedies such as smooth, AWQ, GPTQ or a calibrator fold into the weights and write the same
operators), one representative recipe per group is given to some of the model's own layers (round robin), and that
decoder runs in genai's own generate loop with onnxruntime's profiler on (genai's `enable_profiling` session option).
Each FFN's time in a run is the time of the graph nodes that lie between its input and its output (descendants of
the tensors its first matmuls read, ancestors of the one its last matmul writes), read from the profile; a fused
node onnxruntime names `<node>/<Fusion>/` counts where `<node>` lies. The first run of a request is its prefill, the
others its decode steps (told apart by the tokens the embedding lookup reads). A group's samples are those of its
layers at the model's shape, in genai's session (its threads, its arena, the cache it keeps). A recipe the graph
cannot write gets the reason and is never chosen; the float FFN is timed in float32, as the graph computes.

Per-node times leave out what onnxruntime spends between nodes; the node counts per FFN are in the table
(`nodes`), so a graph of many small nodes (per-token int8) is seen as such.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from ..backends import supports
from ..errors import FFNQuantError
from ..recipe import Recipe, Smooth
from .latency_table import request_row
from .target import Workload
from .vllm_latency import kernel_scheme, round_robin_model

__all__ = ["GENAI_RUNTIME", "graph_groups", "ffn_bounds", "ffn_regions", "token_lookup", "profile_samples",
           "measure_genai_table"]

GENAI_RUNTIME = "genai-cpu"
REQUESTS = 3  # timed requests after one warm-up: each a prefill and `DECODE_STEPS` decode steps
DECODE_STEPS = 16


def graph_groups(recipes: Sequence[Recipe], info: Any) -> tuple[dict[str, list[Recipe]], dict[str, str]]:
    """({group: recipes} in first-seen order, {recipe: why the whole-model graph cannot write it}); a group is named
    by its representative recipe: the round-to-nearest scheme stored the same way with the recipe's graph-changing
    transforms (a float site, a rotation), without what folds into the weights (smooth, a calibrator)."""
    from ..deploy.onnx_model import recipe_refuser

    refuse = recipe_refuser(info)
    groups: dict[str, list[Recipe]] = {}
    refused: dict[str, str] = {}
    for recipe in recipes:
        why = None if recipe.is_float else refuse(recipe)
        if why is not None:
            refused[str(recipe)] = why
            continue
        rep = recipe if recipe.is_float else Recipe(
            kernel_scheme(recipe.scheme), transforms=[t for t in recipe.transforms if not isinstance(t, Smooth)])
        groups.setdefault(str(rep), []).append(recipe)
    return groups, refused


def ffn_regions(nodes: Sequence[Any], bounds: Mapping[int, tuple[Sequence[str], Sequence[str]]]) -> dict[int, set[str]]:
    """{layer: names of the graph nodes of its FFN}: for each layer's (input tensors, output tensors), the nodes
    reachable from an input that reach an output (`nodes`: the graph's NodeProtos, any order)."""
    producer = {out: n for n in nodes for out in n.output}
    readers: dict[str, list[Any]] = {}
    for n in nodes:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    regions = {}
    for layer, (inputs, outputs) in bounds.items():
        below, todo = set(), [r for x in inputs for r in readers.get(x, [])]
        while todo:  # descendants of the inputs
            n = todo.pop()
            if n.name not in below:
                below.add(n.name)
                todo += [r for out in n.output for r in readers.get(out, [])]
        above, todo = set(), [producer[x] for x in outputs if x in producer]
        while todo:  # ancestors of the outputs, within the descendants
            n = todo.pop()
            if n.name in below and n.name not in above:
                above.add(n.name)
                todo += [producer[x] for x in n.input if x in producer]
        regions[layer] = above
    return regions


def ffn_bounds(modules: Sequence[Mapping[str, Any]]) -> dict[int, tuple[list[str], list[str]]]:
    """{layer: (input tensors, output tensors)} of each FFN in a rewritten decoder graph, from `quantize_graph`'s
    module rows: what its first matmuls read and what its last matmul writes (`ffn_regions`' bounds)."""
    bounds: dict[int, tuple[list[str], list[str]]] = {}
    for row in modules:
        ins, outs = bounds.setdefault(row["index"], ([], []))
        if row["weight"] == "w_down":
            outs.append(row["tensors"]["output"])
        else:
            ins.append(row["tensors"]["input"])
    return bounds


def token_lookup(nodes: Sequence[Any]) -> str:
    """The name of the decoder graph's embedding lookup (the Gather reading `input_ids`), or '': the node whose
    input shape tells `profile_samples` how many tokens a run took."""
    return next((n.name for n in nodes if "input_ids" in n.input and n.op_type.startswith("Gather")), "")


def profile_samples(events: Sequence[Mapping[str, Any]], regions: Mapping[int, set[str]], lookup: str,
                    graph_nodes: set[str]) -> dict[str, Any]:
    """Per-FFN times (ms) of one profiled genai session: {"runs": [{request, tokens, ms, ffn: {layer: ms}}] in order
    (`ms` the whole run's),
    "unattributed_share": the share of node time no node of the graph names}. `events`: onnxruntime's profile
    (Chrome trace events); `lookup`: the embedding node that reads `input_ids`, whose input shape says how many
    tokens a run took. A run of more than one token is a prefill and starts a request."""
    import bisect

    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "Session" and e.get("name") == "model_run")
    starts = [a for a, _ in spans]
    owner = {name: layer for layer, names in regions.items() for name in names}
    runs = [{"tokens": 0, "ms": (b - a) / 1000.0, "ffn": dict.fromkeys(regions, 0.0)} for a, b in spans]
    unknown = total = 0.0
    for e in events:
        if e.get("cat") != "Node":
            continue
        k = bisect.bisect_right(starts, e["ts"]) - 1
        if k < 0 or e["ts"] > spans[k][1]:
            continue
        name = e["name"].removesuffix("_kernel_time")
        node = name if name in graph_nodes else name.split("/", 1)[0]
        total += e["dur"]
        if node not in graph_nodes:
            unknown += e["dur"]
            continue
        if node == lookup:
            dims = [d for shape in e.get("args", {}).get("input_type_shape", []) for t, d in shape.items() if t == "int64"]
            runs[k]["tokens"] = int(dims[0][-1]) if dims and dims[0] else 0
        if node in owner:
            runs[k]["ffn"][owner[node]] += e["dur"] / 1000.0
    request = -1
    for run in runs:
        request += run["tokens"] > 1
        run["request"] = request
    return {"runs": [r for r in runs if r["tokens"] > 0 and r["request"] >= 0],
            "unattributed_share": unknown / total if total else 0.0}


def _timing_folder(info: Any, groups: Sequence[str], folder: Path, profile: Path) -> tuple[dict[int, str], dict[int, Any]]:
    """`info`'s model with each group's representative on some of its layers (round robin), written as genai's
    decoder folder in `folder` with onnxruntime's profiler on: ({layer: group}, {layer: (input tensors, output
    tensors)} of its FFN in the graph)."""
    from ..deploy.genai import genai_config, with_known_type, write_genai_files
    from ..deploy.onnx_decoder import cache_layout, export_decoder
    from ..deploy.onnx_rewrite import quantize_graph
    from ..onnx.export import DEFAULT_OPSET

    assigned, planned = round_robin_model(info, groups, "genai", "graphs")
    float_graph = folder / "planned.fp32.onnx"
    export_decoder(planned.model, info, float_graph, DEFAULT_OPSET)
    written = quantize_graph(float_graph, planned, folder / "model.onnx")
    float_graph.unlink()
    bounds = ffn_bounds(written["modules"])
    model = planned.float_model
    # a type genai does not know runs as its generic decoder (`deploy.genai.with_known_type`)
    config = with_known_type(genai_config(model.config, cache_layout(model), "model.onnx",
                                          getattr(model, "generation_config", None)))[0]
    config["model"]["decoder"]["session_options"]["enable_profiling"] = str(profile)
    write_genai_files(folder, info.path, config)
    return assigned, bounds


def _profiled_requests(folder: Path, prompt: Sequence[int], steps: int, requests: int) -> None:
    """One warm-up and `requests` timed requests (`prompt`, then `steps` greedy decode steps) in genai's loop on
    `folder`; the profile is written when the model is freed."""
    import gc

    import onnxruntime_genai as og

    model = og.Model(str(folder))
    for _ in range(requests + 1):
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + steps, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens([list(prompt)])
        while not generator.is_done():
            generator.generate_next_token()
        del generator
    del model
    gc.collect()


def _genai_version() -> str:
    import onnxruntime_genai as og

    return og.__version__


def measure_genai_table(info: Any, recipes: Sequence[Recipe], workload: Workload = Workload(),
                        progress: Callable[[str, int, int], None] | None = None, requests: int = REQUESTS,
                        decode_steps: int = DECODE_STEPS) -> dict[str, dict[str, Any]]:
    """{recipe text: `latency_table.request_row` + {runtime, graph, layers, nodes}, or {reason}}: each candidate's
    FFN time in onnxruntime-genai's generate loop at the model's shape, for `workload` (the module docstring's
    method)."""
    import onnx

    from ..deploy.genai import genai_unavailable
    from ..deploy.onnx_model import graph_refusal
    from ..hf.inputs import position_limit

    why = genai_unavailable() or graph_refusal(info)
    if why is not None:
        raise FFNQuantError(f"plan runtime {GENAI_RUNTIME} is not available here: {why}")
    groups, refused = graph_groups(recipes, info)
    table: dict[str, dict[str, Any]] = {r: {"reason": note} for r, note in refused.items()}
    if not groups:
        return table
    names = list(groups)
    vocab = int(info.config.get("vocab_size") or 2)
    positions = position_limit(info.config) or workload.prompt + decode_steps
    prompt_len = max(2, min(workload.prompt, positions - decode_steps))
    prompt = [(7 + 31 * k) % vocab for k in range(prompt_len)]  # any ids: the time does not depend on them
    with tempfile.TemporaryDirectory(prefix="ffnquant-genai-table-") as tmp:
        folder = Path(tmp) / "folder"
        folder.mkdir()
        if progress:
            progress("latency table in onnxruntime-genai: quantize and write the timing graph", 0, 2)
        assigned, bounds = _timing_folder(info, names, folder, Path(tmp) / "profile")
        if progress:
            progress("latency table in onnxruntime-genai: profile its generate loop", 1, 2)
        _profiled_requests(folder, prompt, decode_steps, requests)
        proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
        profiles = sorted(Path(tmp).glob("profile*.json"))
        if not profiles:
            raise FFNQuantError("plan runtime genai-cpu: onnxruntime-genai ran the timing graph but wrote no profile "
                                f"(its enable_profiling session option); onnxruntime-genai {_genai_version()}")
        events = json.loads(profiles[-1].read_text())
    nodes = list(proto.graph.node)
    regions = ffn_regions(nodes, bounds)
    samples = profile_samples(events, regions, token_lookup(nodes), {n.name for n in nodes})
    timed = [r for r in samples["runs"] if r["request"] >= 1]  # request 0 is the warm-up
    # what the whole-model graph writes for each group's FFN matmuls (`backends.supports('onnx-graph', ...)`)
    kinds = {g: "float" if Recipe.parse(g).is_float else supports("onnx-graph", g, info.spec).kind or "-" for g in names}
    for group in names:
        layers = sorted(i for i, g in assigned.items() if g == group)
        prefill = [r["ffn"][i] for r in timed if r["tokens"] > 1 for i in layers]
        decode = [r["ffn"][i] for r in timed if r["tokens"] == 1 for i in layers]
        if not prefill or not decode:
            for recipe in groups[group]:
                table[str(recipe)] = {"reason": f"genai's profile held no FFN node of the layers given {group}"}
            continue
        row = request_row(prefill, decode, workload)
        first = str(groups[group][0])
        for recipe in groups[group]:
            # `timed_as` on the others only: one row per measurement counts in the table's resolution (`min_gain`)
            same = {"timed_as": first} if str(recipe) != first else {}
            table[str(recipe)] = {**row, **same, "runtime": GENAI_RUNTIME, "graph": group, "layers": layers,
                                  "kernel": kinds[group],
                                  "note": f"timed as {group} on layers {', '.join(map(str, layers))}: "
                                          f"{len(regions[layers[0]])} graph nodes per FFN",
                                  "prompt_timed": prompt_len, "nodes": len(regions[layers[0]]),
                                  "unattributed_share": samples["unattributed_share"]}
    if progress:
        progress("latency table in onnxruntime-genai", 2, 2)
    return table
