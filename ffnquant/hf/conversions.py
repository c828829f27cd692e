"""What transformers' checkpoint conversion mapping says of a model type, for reading its checkpoint by the names
it has on disk: the per-expert tensors it fuses into each 3-D expert parameter (`expert_sources`) and the module
renamings (`with_renames`)."""

from __future__ import annotations

import re
from typing import Any, Sequence

__all__ = ["TENSOR_OPS", "conversion_mapping", "plain_pattern", "expert_sources", "mapping_for", "pretrained_classes", "unread_conversions", "with_renames"]


def expert_sources(model_type: str, ffn: Any, class_names: Sequence[str] = ()) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """From transformers' checkpoint conversion mapping for the model: the per-expert tensor names that make up
    each fused expert parameter (-> ffnquant weight, in the concatenation order) and the module renamings.
    transformers keys a mapping by a model class's name before its model_type (Dots 3's is its text model's class,
    `class_names`: the model's PreTrainedModel classes, outermost first) and so is it looked up here."""
    mapping = mapping_for(model_type, class_names)
    per_expert: dict[str, str] = {}
    renames: list[tuple[str, str]] = []
    for conv in mapping:
        sources = list(getattr(conv, "source_patterns", []) or [])
        targets = list(getattr(conv, "target_patterns", []) or [])
        if type(conv).__name__ == "WeightRenaming":
            renames += [(a.strip("."), b.strip(".")) for a, b in zip(sources, targets)]
            continue
        if len(targets) != 1:
            continue
        param = targets[0].rpartition(".")[2]
        role = ffn.roles.get(param)
        names = [m.group(1) for m in (re.search(r"\*\.([A-Za-z0-9_]+)\.weight$", src) for src in sources) if m]
        if role is None or len(names) != len(sources):
            continue
        parts = role.split("+")
        if len(names) == len(parts):
            per_expert.update(zip(names, parts))
    return per_expert, renames


def with_renames(path_re: str, renames: list[tuple[str, str]]) -> str:
    """`path_re` (a regex of module names) also matching the checkpoint's names before transformers' renamings."""
    for old, new in renames:
        if re.fullmatch(r"[A-Za-z0-9_.]+", old) and re.fullmatch(r"[A-Za-z0-9_.]+", new):
            path_re = path_re.replace(re.escape(new), "(?:" + re.escape(new) + "|" + re.escape(old) + ")")
    return path_re


def pretrained_classes(model: Any) -> tuple[str, ...]:
    """The class names of a model's PreTrainedModel modules, outermost first, each once."""
    return tuple(dict.fromkeys(type(m).__name__ for m in model.modules()
                               if hasattr(m, "config") and hasattr(m, "base_model_prefix")))


def mapping_for(model_type: str, class_names: Sequence[str] = ()) -> list[Any]:
    """transformers' checkpoint conversion mapping looked up as transformers does: by a model class's name first
    (`class_names`, outermost first), then by `model_type`; [] without one (or without transformers' table)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        return next((m for m in map(get_checkpoint_conversion_mapping, [*class_names, model_type]) if m), None) or []
    except Exception:  # an older or newer transformers without it
        return []


def conversion_mapping(model: Any) -> list[Any]:
    """`mapping_for` a built model: its PreTrainedModel classes, then its config's model_type."""
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or "")
    return mapping_for(model_type, pretrained_classes(model))


# transformers' conversion operations that turn one stored tensor into one or several loaded ones by a fixed
# reordering or split (Inkling 2's interleaved w13_weight, HRM's gate_up_proj chunked into gate_proj and up_proj):
# their outputs' shapes follow from the stored tensor's without reading it. Every other operation (Inkling 2 Loop's
# NVFP4 dequantization of a weight and its scales) ffnquant runs as transformers does, with transformers' own
# operation, as it reads (`hf.weights.converted_names`)
TENSOR_OPS = ("Interleave", "Chunk")


def plain_pattern(pattern: Any) -> str:
    """A conversion pattern as the name it matches (its regex escapes removed)."""
    return re.sub(r"\\(.)", r"\1", str(pattern))


def unread_conversions(model_type: str, roles: Sequence[str], class_names: Sequence[str] = ()) -> list[str]:
    """transformers' conversions that make one of the FFN's tensors (`roles`, its attribute names) by operations
    ffnquant does not run as it reads (sharded by another attribute), each as 'sources -> targets (operations)';
    [] where there are none. What it runs: `hf.weights.converted_names`."""
    out = []
    for conv in mapping_for(model_type, class_names):
        if type(conv).__name__ != "WeightConverter":
            continue
        targets = [plain_pattern(t) for t in getattr(conv, "target_patterns", []) or []]
        if not any(t == role or t.endswith("." + role) or f".{role}." in f".{t}." for t in targets for role in roles):
            continue
        sources = [plain_pattern(p) for p in getattr(conv, "source_patterns", []) or []]
        ops = getattr(conv, "operations", []) or []
        if any(getattr(op, "num_shards_attribute", None) is not None for op in ops):
            out.append(f"{' + '.join(sources)} -> {', '.join(targets)} ({', '.join(type(op).__name__ for op in ops)})")
    return out
