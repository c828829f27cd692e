"""The deployment formats `export --model --plan --format` writes, by name, and what each refuses."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..backends import supports
from ..errors import FFNQuantError, unknown_choice

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo

__all__ = ["FORMATS", "get_format", "recipe_refusals"]

FORMATS = {
    "onnx": "each planned FFN layer as a quantized ONNX artifact (QDQ int8, MatMulNBits 4-bit) with manifest.json, "
            "and the whole model as one ONNX graph (prefill, no KV cache) scored on onnxruntime",
    "compressed-tensors": "a Hugging Face model folder whose FFN Linear modules carry compressed-tensors data and a "
                          "quantization_config (what transformers and vLLM load), proven against the measurement",
}


def get_format(name: str) -> str:
    """A format name from FORMATS; an unknown one lists them."""
    key = str(name).strip().lower()
    if key not in FORMATS:
        raise unknown_choice("format", name, FORMATS)
    return key


def recipe_refusals(fmt: str, info: ModelInfo, recipes: Sequence[Any]) -> dict[Any, str]:
    """{recipe: why} for each of `recipes` that `export --format fmt` cannot write on `info`'s model (one line
    each, the format's own refusal: the backend registry's answer, `backends.supports`), decided from the recipes
    alone. FFNQuantError when the format refuses the
    model itself, whatever the recipes: every plan of it would end in a refused export."""
    fmt = get_format(fmt)
    if fmt == "compressed-tensors":
        from . import ctensors
        from .planned import deployable_refusal

        ok, missing = ctensors.ctensors_available()
        why = deployable_refusal(info, fmt) or (None if ok else missing)
        if why is not None:
            raise FFNQuantError(f"format {fmt}: {why}")
        from .experts import experts_refusal, has_experts

        routed = has_experts(info)

        def refusal(recipe: Any) -> str | None:  # routed experts store fewer recipes (`deploy.experts`)
            return supports(fmt, recipe, info.spec).why or (experts_refusal(recipe) if routed else None)
    else:
        from .onnx_model import recipe_refuser

        refusal = recipe_refuser(info)
    out = {}
    for recipe in recipes:
        why = refusal(recipe)
        if why is not None:
            out[recipe] = why
    return out
