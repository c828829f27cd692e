"""No CPU kernel is timed under a scheme name whose numerics differ from that preset.

For every (runtime, scheme) a CPU runtime registers, the bench scores the runtime's own output
against fp32 and against ffnquant's fake-quantized reference of the preset of the same name.
The bench's DIFFERS flag (`REFERENCE_TOLERANCE_DB`, 0.5 dB) must stay off: a kernel computing
another recipe (asymmetric groups under a symmetric name, per-call scales under a static one)
moves the SQNR by more than that (symmetric vs asymmetric int4 groups: 0.5 to 2 dB here;
uint8 asymmetric vs int8 symmetric per token: about 1 dB), while the same recipe in another
summation order or with fp16/bf16 intermediate rounding stays within a few tenths of a dB.

The SQNR gap alone misses a recipe that happens to be as accurate (old tinygemm groups vs the
symmetric w4a16-g128: 0.14 dB; per-call vs calibrated fp8 scales: 0.12 dB), so the output is
also compared with the reference itself. Write the kernel's output as reference + d: the same
recipe leaves d far below the preset's own noise n (bit-exact kernels: 90+ dB; fp16 inputs or
bf16 outputs: 5 to 12 dB below n here), while another recipe of the same width adds an
independent noise of about n's power, putting SQNR(kernel vs reference) near SQNR(reference) or
3 dB under it. Requiring it >= SQNR(reference) + MARGIN_DB (d at most half of n's power) splits
the two cases.
"""

from __future__ import annotations

import pytest

from ffnquant.bench import REFERENCE_TOLERANCE_DB, BenchConfig, run_benchmark
from ffnquant.onnx.ortcpu import int8_kernels
from ffnquant.runtimes.base import FORMATS
from ffnquant.runtimes import get_runtime
from ffnquant.spec import FFNSpec

CPU_RUNTIMES = ["ort-cpu", "torch-cpu", "bnb-cpu", "triton-cpu"]
SPECS = {"relu-d64": FFNSpec("relu", d_model=64), "swiglu-d128": FFNSpec("swiglu", d_model=128)}
FLOAT = ("fp32", "fp16", "bf16")
MARGIN_DB = 3.0


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("name", CPU_RUNTIMES, ids=str)
def test_cpu_kernels_compute_their_presets(monkeypatch, name, spec):
    if name == "triton-cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # Triton runs on a CPU only in its interpreter
    rt = get_runtime(name)
    avail = rt.availability()
    if not avail.available:
        pytest.skip(f"{name} unavailable here: {avail.reason}")
    cfg = BenchConfig(tokens=(1,), budget_s=0.001, warmup=0, min_repeats=1, accuracy_tokens=64, seed=3)
    result = run_benchmark([spec], [rt], None, cfg)  # None: every format the runtime registers
    assert not any(c.error for c in result.cases), [(c.scheme, c.error) for c in result.cases if c.error]
    checked = []
    for c in result.cases:
        if c.scheme in FLOAT:
            continue
        if c.reference_sqnr_db is None:
            # only bitsandbytes' outlier split has no fake-quant reference; it must say so
            assert c.scheme == "llm-int8" and "no reference" in c.reference_note, (c.scheme, c.reference_note)
            continue
        if name == "ort-cpu" and "saturate" in (c.reference_note or ""):
            # this CPU's u8 x s8 kernel saturates 16-bit pair sums (ffnquant.onnx.ortcpu): the case says so and is
            # measured as it runs; its graph's exactness is tests/test_onnxquant.py's
            assert not int8_kernels().u8_exact and FORMATS[c.scheme].scheme.act_dtype.value == "uint8", c.reference_note
            continue
        gap = abs(c.sqnr_db - c.reference_sqnr_db)
        assert gap <= REFERENCE_TOLERANCE_DB, f"{name} {c.scheme}: {c.sqnr_db:.2f} dB vs the preset's {c.reference_sqnr_db:.2f} dB"
        assert c.disagrees_with_reference is False
        assert c.sqnr_vs_reference_db >= c.reference_sqnr_db + MARGIN_DB, \
            f"{name} {c.scheme}: {c.sqnr_vs_reference_db:.1f} dB from the preset, whose own SQNR is {c.reference_sqnr_db:.1f} dB"
        checked.append(c.scheme)
    assert checked, f"{name} registered no quantized scheme that fits {spec.key}"
