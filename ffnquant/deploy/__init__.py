"""Deployable output: a model quantized as its plan says, in the formats serving stacks load.

`planned` builds the quantized model once (ffnquant's own numerics, remedies folded into float weights);
`ctensors` writes it as a Hugging Face folder in compressed-tensors' layout and proves the folder is what
was measured; `onnx_model` writes it as one ONNX graph scored on onnxruntime; `formats` is the registry the
command line picks from; `transformers_loading` is how transformers loads such a folder (routed experts the model
holds fused read from their per-expert tensors, `per_expert_loading`; the model's conversions of float tensors kept as
without a quantization config).
"""

from .ct_loading import transformers_loading
from .expert_loading import per_expert_loading
from .planned import ModuleQuant, PlannedModel, build_planned_model, deployable_refusal

__all__ = ["ModuleQuant", "PlannedModel", "build_planned_model", "deployable_refusal", "per_expert_loading",
           "transformers_loading"]
