"""Real models: FFN layers from local Hugging Face checkpoints, captured calibration, end-to-end accuracy.

Reading checkpoints needs only safetensors; running a model (capture, end-to-end
evaluation) needs the optional `transformers` package (`pip install '.[hf]'`).
"""

from .arch import ARCHITECTURES, HF_ACTIVATIONS, Arch, Install, ModelKind, get_arch, hf_activation
from .checkpoint import (
    HFLayer,
    LayerInfo,
    ModelInfo,
    inspect_model,
    iter_ffn_layers,
    load_ffn_layers,
    parse_layers,
    read_config,
)
from .capture import (
    default_text_path,
    install_ffns,
    iter_captured,
    iter_captured_files,
    load_hf_model,
    load_tokenizer,
    save_captured,
    text_batches,
    transformers_available,
)
from .metrics import compare_models
from .evaluate import (
    EvalSettings,
    LayerInputs,
    calibrate_layers,
    calibrate_model,
    capture_layer_inputs,
    end_to_end,
    evaluate_layers_from_files,
    evaluate_model,
    float_baseline,
    model_file_stem,
    quantize_layers,
    quantize_model_layers,
    quantized_layers,
)

__all__ = [
    "ARCHITECTURES",
    "HF_ACTIVATIONS",
    "Arch",
    "Install",
    "ModelKind",
    "get_arch",
    "hf_activation",
    "HFLayer",
    "LayerInfo",
    "ModelInfo",
    "inspect_model",
    "iter_ffn_layers",
    "load_ffn_layers",
    "parse_layers",
    "read_config",
    "default_text_path",
    "install_ffns",
    "iter_captured",
    "iter_captured_files",
    "load_hf_model",
    "load_tokenizer",
    "save_captured",
    "text_batches",
    "transformers_available",
    "EvalSettings",
    "calibrate_layers",
    "calibrate_model",
    "evaluate_layers_from_files",
    "evaluate_model",
    "LayerInputs",
    "capture_layer_inputs",
    "end_to_end",
    "float_baseline",
    "quantize_layers",
    "quantize_model_layers",
    "quantized_layers",
    "compare_models",
    "model_file_stem",
]
