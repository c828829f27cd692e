"""ffnquant's own GPU kernels (Triton), importable without Triton: each module imports it lazily.

- `w4a16`: fused int4 dequantize + matmul implementing the symmetric `w4a16-g*` presets exactly.
"""
