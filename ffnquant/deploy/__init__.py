"""Deployable output: a model quantized as its plan says, in the formats serving stacks load.

`planned` builds the quantized model once (ffnquant's own numerics, remedies folded into float weights);
`ctensors` writes it as a Hugging Face folder in compressed-tensors' layout and proves the folder is what
was measured; `onnx_model` writes it as one ONNX graph scored on onnxruntime; `formats` is the registry the
command line picks from.
"""

from .planned import ModuleQuant, PlannedModel, build_planned_model, deployable_refusal

__all__ = ["ModuleQuant", "PlannedModel", "build_planned_model", "deployable_refusal"]
