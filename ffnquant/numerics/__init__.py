"""The quantization math on tensors: qparams, (de)quantize and packing (`primitives`), calibrators (`calibrate`),
streaming histograms and observers (`histogram`, `observe`), exact float remedies (`remedies`) and accuracy metrics
(`accuracy`). A core subpackage, the lowest but `infra`: it imports neither the method handlers (`methods`, which
stand on it: the torch reference `methods.fakequant`, AWQ's search `methods.awq`) nor `schemes`."""
