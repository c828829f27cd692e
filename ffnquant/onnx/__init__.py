"""ONNX: the export of an FFN with its parity check (`export`), the one writer of quantized matmul nodes
(`onnxmatmul`), the quantized per-FFN artifacts and onnxruntime sessions (`onnxquant`), what onnxruntime's
int8 CPU kernels compute here (`ortcpu`) and onnxruntime's own quantizers as a baseline (`ortbaseline`).
A core subpackage. (Inside ffnquant, `import onnx` still names the onnx package: imports are absolute.)"""
