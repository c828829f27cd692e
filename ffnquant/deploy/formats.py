"""The deployment formats `export --model --plan --format` writes, by name."""

from __future__ import annotations

from ..errors import unknown_choice

__all__ = ["FORMATS", "get_format"]

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
