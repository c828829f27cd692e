"""The FFN matmuls of an exported causal LM graph rewritten as its plan quantized them (see `deploy.onnx_model`).

Each FFN MatMul is found by name (the module the exporter records on each node), and its integer codes are
the method handler's own (`ModuleQuant.codes`, checked to give the weight back): nothing is quantized twice. What each matmul becomes is
`module_kind`; `quantize_graph` writes the rewritten graph.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import FFNQuantError
from ..onnx.onnxmatmul import EXACT_WEIGHT_ONLY, MS_DOMAIN, MatmulRewriter, check_and_save, matmul_kind, write_matmul

if TYPE_CHECKING:  # annotations only
    from .planned import PlannedModel

__all__ = ["module_kind", "quantize_graph", "MS_DOMAIN", "EXACT_WEIGHT_ONLY"]



# --- what each FFN matmul becomes --------------------------------------------------------------------

def module_kind(m: Any) -> str:
    """What the graph writes for one `ModuleQuant` (`onnxmatmul.matmul_kind`); FFNQuantError (one line naming the
    module and its recipe) for what has no honest graph here."""
    return matmul_kind(m.scheme, m.grid, m.input_mode, m.input_range, f"{m.module} (recipe {m.recipe})")


def _codes(m: Any, w: torch.Tensor) -> torch.Tensor:
    """The integer codes of the planned weight `w` [out, in] (signed, int32; [out, K'] for groups): the method
    handler's own (`ModuleQuant.codes`), checked to give `w` back: the grid is what the model was quantized to, so
    any miss means a wrong graph. Nothing is rounded again."""
    grid, q = m.grid, m.codes
    if q is None:
        raise FFNQuantError(f"{m.module}: the planned module carries no integer codes; was it built by "
                            "build_planned_model?")
    scale, zp = grid.scale.float(), grid.zero_point.to(torch.int32)
    out_f, in_f = w.shape
    if grid.granularity == "per_group":
        g = grid.group_size
        scale, zp = scale.repeat_interleave(g, 1), zp.repeat_interleave(g, 1)
    else:
        scale, zp = scale.reshape(-1, 1) if scale.ndim else scale, zp.reshape(-1, 1) if zp.ndim else zp
    back = ((q - zp).float() * scale)[:, :in_f]
    err = float((back - w).abs().max())
    # exactly on the grid: (code - zp) * scale is the very product that made the weight
    if err > 1e-6 * float(scale.abs().max()):
        raise FFNQuantError(f"{m.module}: the model's weight is not on its {grid.bits}-bit grid (off by {err:.3g}); "
                            "was it built by build_planned_model?")
    return q


# --- the rewrite -------------------------------------------------------------------------------------

def _find_matmuls(proto: Any, planned: PlannedModel) -> dict[str, list[tuple[Any, Any]]]:
    """{module: [(MatMul node, its [in, out] weight initializer)]}, found by name: torch's exporter records on every
    node the modules it came from (`pkg.torch.onnx.name_scopes`, full names under the export wrapper's own
    prefix, e.g. 'model.model.layers.3.mlp.down_proj' for 'model.layers.3.mlp.down_proj'). One node per module,
    or, for a module several layers call (a looped depth: `LayerInfo.shares`), one per call, every one reading
    the one weight initializer."""
    import ast

    import numpy as np
    from onnx import numpy_helper

    inits = {i.name: i for i in proto.graph.initializer}
    uses = Counter(x for n in proto.graph.node for x in n.input)
    dense = [m for m in planned.modules if m.expert is None]  # routed experts are QMoE nodes already
    wanted = {m.module for m in dense}
    # the modules that several layers call: {module: how many layers}
    calls = Counter(m.module for m in dense)
    found: dict[str, list[tuple[Any, Any]]] = {}
    for node in proto.graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2 or node.input[1] not in inits:
            continue
        meta = {p.key: p.value for p in node.metadata_props}
        try:
            scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
        except (ValueError, SyntaxError):
            continue
        if not scopes:
            continue
        # the innermost module scope (the last entry is the op itself): the Linear the MatMul computes
        hits = [m for m in wanted for scope in scopes[-2:] if scope == m or scope.endswith("." + m)]
        for module in hits:
            if module in found and calls[module] < 2:
                raise FFNQuantError(f"{module}: two MatMul nodes of the graph come from it; cannot tell which one "
                                    "is this FFN's")
            found.setdefault(module, []).append((node, inits[node.input[1]]))
    for module, nodes in found.items():
        readers = Counter(init.name for _, init in nodes)
        shared = [name for name, n in readers.items() if uses[name] != n]
        if shared:
            raise FFNQuantError(f"{module}: its weight initializer feeds {uses[shared[0]]} nodes; a shared weight "
                                "cannot be rewritten for one of them")
        if len(nodes) != max(calls[module], 1):
            raise FFNQuantError(f"{module}: {len(nodes)} MatMul nodes of the graph come from it, for "
                                f"{max(calls[module], 1)} call(s) of its layer; cannot tell which are its calls")
        if len(readers) > 1:  # the exporter's own copy of the weight per call (a transpose folded each time)
            first = numpy_helper.to_array(nodes[0][1])
            if any(not np.array_equal(first, numpy_helper.to_array(init)) for _, init in nodes[1:]):
                raise FFNQuantError(f"{module}: the MatMul nodes of its calls read different weights")
    missing = [m.module for m in dense if m.module not in found]
    if missing:
        raise FFNQuantError(f"could not find the matmul(s) of {', '.join(missing[:3])}"
                            f"{' and more' if len(missing) > 3 else ''} in the graph (no MatMul with a weight "
                            "initializer names them in pkg.torch.onnx.name_scopes)")
    return found


def quantize_graph(float_path: str | os.PathLike, planned: PlannedModel, out_path: str | os.PathLike) -> dict[str, Any]:
    """Rewrite the FFN matmuls of `float_path` (the export of `planned.model`) as `planned.modules` say (module
    docstring) into `out_path`. Every module is checked before the graph is read. Returns what was written per
    module, the op counts before and after, and the files' bytes."""
    import onnx
    from onnx import helper

    # routed experts are written by the export itself, as QMoE nodes (`deploy.onnx_experts`)
    dense = [m for m in planned.modules if m.expert is None]
    kinds = {m.module: module_kind(m) for m in dense}
    proto = onnx.load(str(float_path))
    before = Counter(n.op_type for n in proto.graph.node)
    found = _find_matmuls(proto, planned)
    position = {id(n): i for i, n in enumerate(proto.graph.node)}
    ends = {module: (nodes[0][0].input[0], nodes[0][0].output[0]) for module, nodes in found.items()}
    rw = MatmulRewriter(proto.graph)
    # each module once (a looped depth's later calls are their first call's quantization, one ModuleQuant each),
    # every MatMul calling it in graph order: a shared input's quantizer goes before its first reader (w_gate or w_up)
    first = {m.module: m for m in reversed(dense)}
    calls = [(m, k, node, init) for m in first.values() for k, (node, init) in enumerate(found[m.module])]
    for m, k, node, init in sorted(calls, key=lambda c: position[id(c[2])]):
        kind = kinds[m.module]
        w = planned.model.get_submodule(m.module).weight.detach().float()
        codes = None if kind in ("float", "act-qdq") else _codes(m, w)
        write_matmul(rw, node, init, kind, scheme=m.scheme, grid=m.grid, codes=codes, input_mode=m.input_mode,
                     input_range=m.input_range, prefix=m.module.replace(".", "_"), in_features=w.shape[1],
                     rotation=m.rotation, call=f"_call{k}" if k else "")
    rw.finish()
    if "nbits" in kinds.values() and not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    proto.ir_version = min(proto.ir_version, 10)
    props = {**{p.key: p.value for p in proto.metadata_props}, "ffnquant_graph": "quantized"}
    if "weight-dq" in kinds.values():
        # a default session turns DequantizeLinear -> MatMul into MatMulNBits at accuracy level 4, which quantizes
        # the activations on the fly: w8a16 computes what it says only with this entry (onnxquant.ort_session)
        props["ffnquant_session_config"] = f"{EXACT_WEIGHT_ONLY}=0"
    helper.set_model_props(proto, props)
    after = Counter(n.op_type for n in proto.graph.node)
    check_and_save(proto, out_path)
    # the tensors each matmul reads and writes keep their names through the rewrite: where its FFN lies in the graph
    rows = [{"module": m.module, "layer": m.layer, "index": m.index, "weight": m.weight, "recipe": m.recipe,
             "kind": kinds[m.module], "rotation": m.rotation is not None,
             "tensors": {"input": ends[m.module][0], "output": ends[m.module][1]}} for m in dense]
    # the file's name, not its path: it is written in a staging folder that is renamed, and a report names no
    # folder of this machine
    return {"file": Path(out_path).name, "modules": rows, "kinds": dict(Counter(kinds.values())),
            "nodes": {"float": dict(before), "quantized": dict(after)},
            "n_nodes": {"float": sum(before.values()), "quantized": sum(after.values())},
            "bytes": {"source": os.path.getsize(float_path), "quantized": os.path.getsize(out_path)}}


