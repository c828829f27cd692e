"""Triton code shared by ffnquant's kernels, written once: an FFN activation and the rounding to a 16-bit dtype.

These are plain functions in Triton's language, not decorated: a kernel module decorates them for the mode it
runs in (`tritonenv.jit_per_mode`), since triton.jit binds a function to compiled or interpreted execution when it
decorates. `tl` is set by `import_tl` before the first decoration (the functions resolve it from these globals,
which `jit_per_mode` copies from the calling module's, where the same name is bound).
"""

from __future__ import annotations

tl = None  # triton.language, in the decorating module's globals

__all__ = ["act", "round_to"]


def act(g, ACT: tl.constexpr):
    # ACT: the index in w4a16_pack.ACTIVATIONS (5, identity, leaves g); the FFN's activations in torch's operation order (gelu_tanh as z * sigmoid(2u), equal in exact math); division
    # correctly rounded (`div_rn`: Triton's `/` is approximate on a GPU), as torch divides
    if ACT == 0:
        g = tl.math.div_rn(g, 1.0 + tl.exp(-g))
    elif ACT == 1:
        g = g * 0.5 * (1.0 + tl.erf(g * 0.7071067811865476))
    elif ACT == 2:
        g = tl.math.div_rn(g, 1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))
    elif ACT == 3:
        g = tl.maximum(g, 0.0)
    elif ACT == 4:
        g = tl.math.div_rn(1.0, 1.0 + tl.exp(-g))
    return g


def round_to(v, DKIND: tl.constexpr):
    # v (float32) rounded to float16 (DKIND 1) / bfloat16 (2) as torch rounds it, kept in float32 (0: unchanged);
    # bf16 on the bits, because the interpreter truncates float32 -> bf16 (round to nearest even; NaN passes through)
    if DKIND == 2:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        v = tl.where(v == v, bits.to(tl.float32, bitcast=True), v)
    elif DKIND == 1:
        v = v.to(tl.float16).to(tl.float32)
    return v
