"""The quantization numerics on tensors: the math (`primitives`), calibrators (`calibrate`), streaming
histograms and observers (`histogram`, `observe`), the torch reference of a quantized FFN (`fakequant`),
exact float remedies (`remedies`, `awq`) and accuracy metrics (`accuracy`). A core subpackage: it sits
beside the loose modules, below every layered subpackage."""
