"""transformers' loader as a compressed-tensors folder of ffnquant's needs it: `transformers_loading(folder)`.

Two things transformers' own `from_pretrained` does not do for such a folder:
- routed experts the model holds fused on disk, written per expert (`expert_loading.per_expert_loading`);
- a model's own checkpoint conversions on tensors the folder stores in float. With a quantization config present,
  transformers (5.x, up to at least 5.25) adds its compressed-tensors dequantization to every converter of the
  model's conversion mapping whose sources are weights, quantized or not: HRM's fused attention (one tensor chunked
  into four) then becomes a many-to-many converter transformers refuses to build, and Inkling 2's lm_head reaches its
  unpadding as nothing (the dequantization of a float tensor returns none). `float_converters_kept` keeps such a
  converter as the model's mapping writes it wherever the folder stores no quantized tensor it would collect;
  converters over quantized tensors (experts merged at load) get transformers' step as before.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from typing import Any, Iterator

from .expert_loading import _stored_names, per_expert_loading

__all__ = ["float_converters_kept", "transformers_loading"]

# what compressed-tensors stores beside each quantized weight in every format ffnquant writes
_QUANTIZED_SUFFIX = "_scale"


def _collects_quantized(converter: Any, weights: set[str]) -> bool:
    """Whether `converter`'s sources match a weight the folder stores quantized (`weights`: those weights' names,
    stored and as transformers renames them). A wildcard source (experts merged at load) is taken to: transformers'
    own handling stays."""
    sources = [str(s) for s in getattr(converter, "_original_source_patterns", None) or ()]
    if not sources or any("*" in s for s in sources):
        return True
    try:
        return any(re.search(s, w) for s in sources for w in weights)
    except re.error:
        return True


def _quantized_weights(folder: Path) -> set[str]:
    """The names of the weights `folder` stores quantized (a `<name>_scale` beside), stored and as loaded."""
    from ..hf.conversions import mapping_for
    from ..hf.checkpoint import read_config
    from ..hf.weights import loaded_names

    stored = {k[: -len(_QUANTIZED_SUFFIX)] for k in _stored_names(folder) if k.endswith(".weight" + _QUANTIZED_SUFFIX)}
    model_type = str(read_config(folder).get("model_type") or "")
    return stored | set(loaded_names(stored, mapping_for(model_type)))


@contextlib.contextmanager
def float_converters_kept(folder: str | Path) -> Iterator[list[str]]:
    """While active, transformers' compressed-tensors loading adds its dequantization only to the model's converters
    that collect a tensor `folder` stores quantized; yields the source patterns of those kept as the mapping writes
    them (filled as transformers builds its converters). A transformers without that step: nothing changed."""
    try:
        from transformers.core_model_loading import WeightConverter
        from transformers.quantizers.quantizer_compressed_tensors import CompressedTensorsHfQuantizer
    except ImportError:
        yield []
        return
    original = getattr(CompressedTensorsHfQuantizer, "update_weight_conversions", None)
    if original is None:
        yield []
        return
    weights = _quantized_weights(Path(folder))
    kept: list[str] = []

    def update(self: Any, conversions: list, model: Any) -> list:
        general = len(self.get_weight_conversions())  # the quantizer's own converters, appended once at the end
        out: list = []
        for converter in conversions:
            if isinstance(converter, WeightConverter) and not _collects_quantized(converter, weights):
                out.append(converter)
                kept.extend(str(s) for s in converter._original_source_patterns)
                continue
            made = original(self, [converter], model)
            out += made[: len(made) - general]
        return out + self.get_weight_conversions()

    own = "update_weight_conversions" in vars(CompressedTensorsHfQuantizer)
    CompressedTensorsHfQuantizer.update_weight_conversions = update
    try:
        yield kept
    finally:
        if own:
            CompressedTensorsHfQuantizer.update_weight_conversions = original
        else:
            del CompressedTensorsHfQuantizer.update_weight_conversions


@contextlib.contextmanager
def transformers_loading(folder: str | Path) -> Iterator[dict[str, list[str]]]:
    """While it runs, transformers' `from_pretrained` loads `folder` as ffnquant wrote it: routed experts held fused
    read from their per-expert tensors, and the model's conversions of float tensors applied as without a
    quantization config. Yields {"per_expert": the experts modules so read, "float_converters": the converters kept
    as the model's mapping writes them}, each filled as transformers loads.

        with ffnquant.deploy.transformers_loading(folder):
            model = AutoModelForCausalLM.from_pretrained(folder)
    """
    with per_expert_loading(folder) as per_expert, float_converters_kept(folder) as kept:
        yield {"per_expert": per_expert, "float_converters": kept}
