"""ffnquant's own GPU kernels (Triton), importable without Triton: each module imports it lazily.

- `w4a16_tiled` (on `w4a16_repack`'s layout): the W4A16 kernel the `triton` runtime runs, int4 dequantize fused into
  the matmul, the symmetric `w4a16-g*` presets exactly; `w4a16` (on `w4a16_pack`): the first one, kept as the
  baseline the device benchmark compares against.
- `actquant`, `actquant_ffn`: per-token int8 / fp8 activation quantization fused into one pass (and the
  FFN modules on it), the numerics of torch_rt's w8a8-dynamic-s8 and fp8-e4m3-dynamic paths bit for bit.
"""
