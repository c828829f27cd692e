"""Runtime adapters: registry, availability reasons, and every adapter that runs here against its scheme's reference."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.onnx.export import export_onnx, fp16_tolerance
from ffnquant.model import build
from ffnquant.runtimes import FORMATS, ModelCase, get_format, get_runtime, parse_formats, runtime_names
from ffnquant.spec import FFNSpec

D = 64  # tiny: d_ff 256 dense, 256 gated (multiple_of 128)
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def sqnr_db(ref: np.ndarray, got: np.ndarray) -> float:
    noise = float(np.sum((got.astype(np.float64) - ref) ** 2))
    return math.inf if noise == 0 else 10 * math.log10(float(np.sum(ref.astype(np.float64) ** 2)) / noise)


def with_linears(model, linear_fn):
    """A copy of `model` whose projections compute `linear_fn(x, weight, bias)` (the scheme's reference math)."""

    class Ref(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.weight = lin.weight.detach().double()
            self.bias = None if lin.bias is None else lin.bias.detach().double()

        def forward(self, x):
            return linear_fn(x.double(), self.weight, self.bias)

    ref = copy.deepcopy(model).double()
    for name in model.spec.weight_names:
        setattr(ref, name, Ref(getattr(model, name)))
    return ref


def run_ref(ref_model, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return ref_model(torch.from_numpy(x).double()).numpy()


def affine(x, w, b):
    y = x @ w.T
    return y if b is None else y + b


@pytest.fixture(scope="module", params=["relu", "swiglu"])
def tiny(request):
    spec = FFNSpec(request.param, d_model=D)
    model = build(spec, seed=3)
    x = np.random.default_rng(0).standard_normal((1, 24, D)).astype(np.float32)
    return spec, model, x


# --- registry and formats -------------------------------------------------------------------
def test_registry_lists_every_runtime():
    assert set(runtime_names()) == {"ort-cpu", "ort-cuda", "ort-trt", "torch-cpu", "torch-cuda", "torch-cuda-graph",
                                    "torch-cuda-compile", "triton-cuda", "triton-cpu", "bnb-cpu", "bnb-cuda"}
    for name in runtime_names():
        assert get_runtime(name).name == name


def test_unknown_runtime_lists_valid_names():
    with pytest.raises(FFNQuantError, match=r"unknown runtime 'tensorflow'; valid: ort-cpu, .*bnb-cuda"):
        get_runtime("tensorflow")


def test_unknown_scheme_lists_valid_names():
    with pytest.raises(FFNQuantError, match=r"unknown scheme 'int3'; valid: fp32, fp16, bf16"):
        get_format("int3")
    assert parse_formats("fp16, w8a8,fp16") == ["fp16", "w8a8"]


def test_every_runtime_format_is_registered():
    for name in runtime_names():
        assert set(get_runtime(name).formats) <= set(FORMATS), name


# --- availability -------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["ort-cuda", "ort-trt"])
def test_ort_gpu_providers_unavailable_with_reason(name):
    avail = get_runtime(name).availability()
    assert not avail.available
    assert avail.device == "cuda"
    # Either the CPU-only package (no provider) or onnxruntime-gpu falling back without CUDA libraries.
    assert re.search(r"fell back to CPU|has no (CUDA|Tensorrt)ExecutionProvider", avail.reason), avail.reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["torch-cuda", "bnb-cuda"])
def test_cuda_runtimes_unavailable_without_device(name):
    avail = get_runtime(name).availability()
    assert not avail.available and "no CUDA device" in avail.reason


@pytest.mark.parametrize("name", ["ort-cpu", "torch-cpu", "bnb-cpu"])
def test_cpu_runtimes_available(name):
    avail = get_runtime(name).availability()
    assert avail.available and avail.device == "cpu", avail.reason


def test_unavailable_runtime_refuses_to_load(tiny):
    spec, model, _ = tiny
    rt = get_runtime("ort-cuda")
    if rt.availability().available:
        pytest.skip("CUDA provider really available here")
    with pytest.raises(FFNQuantError, match="unavailable"):
        rt.load(ModelCase(spec, "fp16", model=model))


# --- bad input --------------------------------------------------------------------------------------
def test_unsupported_scheme_is_an_error(tiny):
    spec, model, _ = tiny
    with pytest.raises(FFNQuantError, match=r"runtime 'ort-cpu' does not support scheme 'bf16'; it supports: fp32"):
        get_runtime("ort-cpu").load(ModelCase(spec, "bf16", model=model))
    with pytest.raises(FFNQuantError, match="does not support scheme 'w8a8'"):
        get_runtime("bnb-cpu").check(ModelCase(spec, "w8a8"))


def test_group_size_that_does_not_divide_is_an_error():
    spec = FFNSpec("relu", d_model=D)  # d_model 64 is not a multiple of 128
    with pytest.raises(FFNQuantError, match="divisible by 128"):
        get_runtime("torch-cpu").check(ModelCase(spec, "w4a16-g128-asym"))


@pytest.mark.parametrize("name", ["torch-cpu", "bnb-cpu"])
def test_input_shape_mismatch_is_an_error(tiny, name):
    spec, model, _ = tiny
    rt = get_runtime(name)
    loaded = rt.load(ModelCase(spec, "fp32", model=model))
    with pytest.raises(FFNQuantError, match=f"input last dimension {D + 1} does not match the model's d_model {D}"):
        rt.prepare(loaded, np.zeros((1, 4, D + 1), np.float32))
    with pytest.raises(FFNQuantError, match="must be"):
        rt.prepare(loaded, np.zeros((D,), np.float32))


# --- onnxruntime CPU ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx")


@pytest.fixture(scope="module")
def prebuilt_nbits(tiny, tmp_path_factory):
    """A MatMulNBits model made with onnxruntime's own quantizer, run through `onnx_path`."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    spec, model, _ = tiny
    folder = tmp_path_factory.mktemp(f"prebuilt_{spec.variant.value}")
    fp32, _ = export_onnx(model, folder / "fp32.onnx")
    quant = MatMulNBitsQuantizer(onnx.load(str(fp32)), block_size=32, is_symmetric=True)
    quant.process()
    quant.model.save_model_to_file(str(folder / "nbits.onnx"))
    return folder / "nbits.onnx"


# SQNR floors from the formats' math: uniform b-bit rounding of Gaussian-like data clipped at
# absmax ~ 4 std gives about 6.02 b + 4.77 - 20 log10(4) dB per tensor (~41 dB at 8 bits,
# ~17 dB at 4 bits; groups of 32 clip closer); an FFN compounds three or four such tensors
# (input, weights, hidden) and static activation ranges clip or waste range, losing up to
# ~12 dB. Floors sit below that.
SQNR_FLOOR = {"w8a16": 30.0, "w8a8": 22.0, "w4a16-g32": 12.0, "nf4": 12.0}
# Kernels the CPU provider must really run for each format (after its graph fusions).
ORT_KERNEL = {"w8a8": "MatMulIntegerToFloat", "w4a16-g32": "MatMulNBits", "nf4": "MatMulBnb4"}


@pytest.mark.parametrize("scheme", ["fp32", "fp16", "w8a16", "w8a8", "w4a16-g32", "nf4"], ids=str)
def test_ort_cpu_agrees_with_torch(tiny, onnx_dir, scheme):
    spec, model, x = tiny
    rt = get_runtime("ort-cpu")
    loaded = rt.load(ModelCase(spec, scheme, model=model, workdir=onnx_dir))  # built by export / onnxquant
    assert loaded.providers[0] == "CPUExecutionProvider"
    assert loaded.file_bytes > 0 and loaded.weight_bytes > 0
    got = rt(loaded, x)
    ref = run_ref(with_linears(model, affine), x)
    assert got.shape == ref.shape
    if scheme == "fp32":
        assert np.max(np.abs(got - ref)) <= 1e-4
    elif scheme == "fp16":
        assert np.max(np.abs(got - ref)) <= fp16_tolerance(float(np.max(np.abs(ref))))
    else:
        assert sqnr_db(ref, got) >= SQNR_FLOOR[scheme]
        assert loaded.weight_bytes < spec.n_params * 4 / 3  # 8 bits or fewer per weight, plus scales
    if scheme in ORT_KERNEL:
        assert ORT_KERNEL[scheme] in loaded.label


def test_ort_cpu_runs_a_prebuilt_file(tiny, prebuilt_nbits):
    spec, model, x = tiny
    rt = get_runtime("ort-cpu")
    loaded = rt.load(ModelCase(spec, "w4a16-g32", model=model, onnx_path=prebuilt_nbits))
    assert loaded.extra["onnx_path"] == str(prebuilt_nbits)
    assert sqnr_db(run_ref(with_linears(model, affine), x), rt(loaded, x)) >= SQNR_FLOOR["w4a16-g32"]


def test_ort_cpu_rejects_missing_file(tiny, tmp_path):
    spec, model, _ = tiny
    with pytest.raises(FFNQuantError, match="does not exist"):
        get_runtime("ort-cpu").load(ModelCase(spec, "fp32", model=model, onnx_path=tmp_path / "nope.onnx"))


def test_ort_cpu_builds_float_artifacts_itself(tiny, tmp_path):
    spec, model, x = tiny
    rt = get_runtime("ort-cpu")
    loaded = rt.load(ModelCase(spec, "fp32", model=model, workdir=tmp_path))
    assert loaded.extra["onnx_path"].startswith(str(tmp_path))
    assert np.max(np.abs(rt(loaded, x[0]) - run_ref(with_linears(model, affine), x)[0])) <= 1e-4  # 2-D input too


# --- torch ------------------------------------------------------------------------------------
def _int8_rows(t):
    scale = t.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(t / scale).clamp(-127, 127), scale


def ref_w8a8_dynamic_s8(x, w, b):
    """Per-token int8 input x per-channel int8 weight, exact integer products, float rescale."""
    xq, sx = _int8_rows(x.float())
    wq, sw = _int8_rows(w.float())
    return affine(xq.double() * sx.double(), wq.double() * sw.double(), b)


def ref_w8a16(x, w, b):
    wq, sw = _int8_rows(w.float())
    return affine(x, wq.double() * sw.double(), b)


def ref_w4_asym_groups(group):
    """The w4a16-g*-asym preset: each group's [min(lo, 0), max(hi, 0)] over codes 0..15, integer zero point."""

    def fn(x, w, b):
        n, k = w.shape
        wg = w.float().reshape(n, k // group, group)
        lo, hi = wg.amin(-1, keepdim=True).clamp(max=0), wg.amax(-1, keepdim=True).clamp(min=0)
        scale = (hi - lo) / 15.0
        zp = torch.round(-lo / scale).clamp(0, 15)
        q = (torch.round(wg / scale) + zp).clamp(0, 15)
        deq = ((q - zp) * scale).reshape(n, k)
        return affine(x, deq.double(), b)

    return fn


def round_to(dtype):
    return lambda x, w, b: affine(x.to(dtype).double(), w.to(dtype).double(), None if b is None else b.to(dtype).double())


# (reference, tolerance on max |error| relative to the output's absmax). fp16/bf16: the
# output and every intermediate are rounded to the unit roundoff (2^-11, 2^-8), a few times.
TORCH_CASES = {
    "fp32": (affine, 1e-5),
    "fp16": (round_to(torch.float16), 8 * 2**-11),
    "bf16": (round_to(torch.bfloat16), 8 * 2**-8),
    "w8a8-dynamic-s8": (ref_w8a8_dynamic_s8, 1e-4),
    "w8a16": (ref_w8a16, 1e-4),
    "w4a16-g32-asym": (ref_w4_asym_groups(32), 1e-4),
    "w4a16-g64-asym": (ref_w4_asym_groups(64), 1e-4),
}


@pytest.mark.parametrize("scheme", list(TORCH_CASES), ids=str)
def test_torch_cpu_agrees_with_scheme_reference(tiny, scheme):
    spec, model, x = tiny
    rt = get_runtime("torch-cpu")
    if scheme not in rt.formats:
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for {scheme}")
    loaded = rt.load(ModelCase(spec, scheme, model=model))
    got = rt(loaded, x)
    fn, rel = TORCH_CASES[scheme]
    ref = run_ref(with_linears(model, fn), x)
    assert np.max(np.abs(got - ref)) <= rel * max(1.0, float(np.max(np.abs(ref)))), scheme


def ref_fp8_rowwise(x, w, b):
    """e4m3 with one absmax/448 scale per token (x) and per output channel (w); the GEMM's output in bf16."""
    def q(t):
        s = t.abs().amax(dim=-1, keepdim=True).float() / 448.0
        return (t.float() / s).to(torch.float8_e4m3fn).double() * s.double()

    y = (q(x) @ q(w).T).to(torch.bfloat16).double()
    return y if b is None else y + b


def test_torch_cpu_fp8_rowwise_agrees_with_its_math(tiny):
    spec, model, x = tiny
    rt = get_runtime("torch-cpu")
    if "fp8-e4m3-dynamic" not in rt.formats:
        pytest.skip(f"torch {torch.__version__} has no row-wise _scaled_mm on CPU")
    got = rt(rt.load(ModelCase(spec, "fp8-e4m3-dynamic", model=model)), x)
    ref = run_ref(with_linears(model, ref_fp8_rowwise), x)
    # Same products and scales; the kernel and the reference may round a bf16 output to the
    # neighbouring value (2^-8 relative), which can move an fp8 code of the next matmul's input
    # by one step (2^-3 relative on that element). Both are far below fp8's own noise (about 24 dB
    # here): 40 dB of agreement separates "same numerics" from "other scaling" (which is ~24 dB).
    assert sqnr_db(ref, got) >= 40


@pytest.mark.parametrize("name,mode", [("torch", "graph"), ("torch", "compile")], ids=["graph", "compile"])
def test_cuda_graph_modes_refuse_the_cpu(name, mode):
    from ffnquant.runtimes.torch_rt import TorchRuntime

    with pytest.raises(FFNQuantError, match=f"mode '{mode}' replays CUDA graphs: it needs device 'cuda'"):
        TorchRuntime("cpu", mode)
    with pytest.raises(FFNQuantError, match="unknown torch mode 'jit'; valid: eager, graph, compile"):
        TorchRuntime("cuda", "jit")


def test_mode_runtimes_are_named_and_described():
    graph, compiled = get_runtime("torch-cuda-graph"), get_runtime("torch-cuda-compile")
    assert (graph.mode, compiled.mode) == ("graph", "compile")
    assert "CUDA graph" in graph.description and "torch.compile" in compiled.description
    # compile time is paid per model and shape: only the float and per-token dynamic formats
    assert compiled.formats == ("fp16", "bf16", "w8a8-dynamic-s8", "fp8-e4m3-dynamic")


def test_triton_runtime_says_why_it_cannot_run_on_this_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    avail = get_runtime("triton-cuda").availability()
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    assert not avail.available and "no CUDA device" in avail.reason


def test_torch_cpu_weight_bytes_shrink_with_bits(tiny):
    spec, model, _ = tiny
    rt = get_runtime("torch-cpu")
    sizes = {s: rt.load(ModelCase(spec, s, model=model)).weight_bytes
             for s in ("fp32", "fp16", "w8a16", "w4a16-g32-asym")}
    assert sizes["fp32"] > sizes["fp16"] > sizes["w8a16"] > sizes["w4a16-g32-asym"]


# --- bitsandbytes --------------------------------------------------------------------------------
def ref_llm_int8(threshold):
    """LLM.int8 from fp16 inputs: input columns with any |x| > threshold in float (against the
    int8-dequantized weight), the rest row-wise int8 x row-wise int8 weights."""

    def fn(x, w, b):
        x = x.half().double()
        wq, sw = _int8_rows(w.float())
        w_deq = wq.double() * sw.double()
        x2 = x.reshape(-1, x.shape[-1])
        outlier = (x2.abs() > threshold).any(dim=0) if threshold > 0 else torch.zeros(x2.shape[-1], dtype=torch.bool)
        regular = x2.masked_fill(outlier, 0.0)
        xq, sx = _int8_rows(regular.float())
        y = (xq.double() * sx.double()) @ w_deq.T
        y = y + x2[:, outlier] @ w_deq[:, outlier].T
        y = y.reshape(*x.shape[:-1], -1)
        return y if b is None else y + b

    return fn


@pytest.mark.parametrize("scheme", ["llm-int8", "llm-int8-t0", "nf4", "fp4"], ids=str)
def test_bnb_cpu_agrees_with_scheme_reference(tiny, scheme):
    import bitsandbytes.functional as bnbF

    spec, model, x = tiny
    x = x.copy()
    x[..., 5] *= 12.0  # an outlier feature: LLM.int8 takes this column out of int8 at threshold 6
    rt = get_runtime("bnb-cpu")
    loaded = rt.load(ModelCase(spec, scheme, model=model))
    if not scheme.startswith("llm-int8"):
        # Dequantize before the first call: bitsandbytes may repack 4-bit weights for its CPU kernel then.
        deq = {name: bnbF.dequantize_4bit(getattr(loaded.handle, name).weight.data,
                                          getattr(loaded.handle, name).weight.quant_state).float()
               for name in spec.weight_names}
    got = rt(loaded, x)
    if scheme.startswith("llm-int8"):
        own, other = (6.0, 0.0) if scheme == "llm-int8" else (0.0, 6.0)
        ref = run_ref(with_linears(model, ref_llm_int8(own)), x)
        alt = run_ref(with_linears(model, ref_llm_int8(other)), x)
        # bitsandbytes rounds x * (127 / absmax) in fp16 arithmetic and carries fp16 hidden
        # activations, so some elements land one int8 step away from the float64 emulation
        # (an rms error near 1% of the signal, ~40 dB). The runtime must agree with its own
        # threshold's emulation within that and clearly better than with the other threshold's.
        assert sqnr_db(ref, got) >= 35.0, scheme
        assert sqnr_db(ref, got) >= sqnr_db(alt, got) + 3.0, scheme
    else:
        ref_model = copy.deepcopy(model)
        with torch.no_grad():
            for name, w in deq.items():
                getattr(ref_model, name).weight.copy_(w)
        ref = run_ref(with_linears(ref_model, affine), x)
        # Against its own dequantized weights; bitsandbytes' CPU 4-bit path computes in bf16
        # (unit roundoff 2^-8), a few roundings deep.
        assert np.max(np.abs(got - ref)) <= 8 * 2**-8 * max(1.0, float(np.max(np.abs(ref)))), scheme
    assert "bitsandbytes" in loaded.label


def test_bnb_outlier_threshold_helps_with_outlier_features(tiny):
    spec, model, x = tiny
    x = x.copy()
    x[..., 5] *= 12.0
    ref = run_ref(with_linears(model, affine), x)
    rt = get_runtime("bnb-cpu")
    with_split = sqnr_db(ref, rt(rt.load(ModelCase(spec, "llm-int8", model=model)), x))
    without = sqnr_db(ref, rt(rt.load(ModelCase(spec, "llm-int8-t0", model=model)), x))
    assert with_split > without


# --- GPU (skipped here) ------------------------------------------------------------------------------
@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("scheme", ["fp16", "bf16", "w8a8-dynamic-s8", "w4a16-g64-asym", "fp8-e4m3"], ids=str)
def test_torch_cuda_agrees_with_scheme_reference(scheme):
    spec = FFNSpec("swiglu", d_model=128)
    model = build(spec, seed=3)
    x = np.random.default_rng(0).standard_normal((1, 24, 128)).astype(np.float32)
    rt = get_runtime("torch-cuda")
    if scheme not in rt.formats:
        pytest.skip(f"no CUDA kernel for {scheme} on this device")
    got = rt(rt.load(ModelCase(spec, scheme, model=model)), x)
    ref = run_ref(with_linears(model, affine), x)
    floor = {"fp16": 50, "bf16": 35, "w8a8-dynamic-s8": 28, "w4a16-g64-asym": 12, "fp8-e4m3": 18}[scheme]
    assert sqnr_db(ref, got) >= floor


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("name", ["torch-cuda-graph", "torch-cuda-compile"])
@pytest.mark.parametrize("scheme", ["fp16", "w8a8-dynamic-s8"], ids=str)
def test_graph_and_compile_modes_match_eager(name, scheme):
    spec = FFNSpec("swiglu", d_model=128)
    model = build(spec, seed=3)
    x = np.random.default_rng(0).standard_normal((1, 5, 128)).astype(np.float32)
    eager, other = get_runtime("torch-cuda"), get_runtime(name)
    want = eager(eager.load(ModelCase(spec, scheme, model=model)), x)
    got = other(other.load(ModelCase(spec, scheme, model=model)), x)
    if name.endswith("graph"):  # a replayed graph runs the same kernels: bit-identical
        assert np.array_equal(got, want)
    elif scheme == "fp16":  # inductor may fuse and reorder fp16 rounding steps: a few units of roundoff
        assert np.max(np.abs(got - want)) <= 8 * 2**-11 * float(np.max(np.abs(want)))
    else:
        # Inductor computes the per-token scales in another order, so a few int8 codes of the
        # hidden activation land one step apart (seen on an H200: max difference 0.0127 on an
        # output of absmax ~0.55). Each such flip is sparse noise far below int8's own (~30 dB
        # against fp32); 40 dB between the two outputs says "same numerics".
        assert sqnr_db(want.astype(np.float64), got) >= 40


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("name", ["torch-cuda", "torch-cuda-graph", "bnb-cuda", "triton-cuda"])
def test_cuda_runtime_available_on_gpu(name):
    assert get_runtime(name).availability().available





# --- bitsandbytes' third-party noise --------------------------------------------------------------

_BNB_NOISE = ("pip install kernels", "kernels-community")


def test_bnb_runtime_keeps_the_pip_install_kernels_warning_off_stderr():
    """bitsandbytes logs 'Failed to load CPU gemm_4bit_forward from kernels-community ... pip install kernels' at
    import (a package ffnquant does not use): importing and running the bnb runtime shows no such line, even
    with every logger at DEBUG. A fresh interpreter, since the warning is logged once, at import."""
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")
    code = (
        "import logging, sys; logging.basicConfig(level=logging.DEBUG, stream=sys.stderr)\n"
        "from ffnquant.runtimes import ModelCase, get_runtime\n"
        "from ffnquant.spec import FFNSpec\n"
        "rt = get_runtime('bnb-cpu'); assert rt.availability().available, rt.availability()\n"
        "import torch\n"
        "loaded = rt.load(ModelCase(FFNSpec('swiglu', d_model=64), 'nf4'))\n"
        "rt.run(loaded, rt.prepare(loaded, torch.randn(4, 64).numpy()))\n"
        "print('ran')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "ran" in proc.stdout
    noisy = [line for line in (proc.stdout + proc.stderr).splitlines() if any(n in line for n in _BNB_NOISE)]
    assert not noisy


def test_bnb_noise_filter_passes_other_records():
    import logging

    from ffnquant.infra.thirdparty import quiet_bitsandbytes

    quiet_bitsandbytes()
    quiet_bitsandbytes()  # idempotent: one filter
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    assert len(logger.filters) == 1
    f = logger.filters[0]

    def rec(msg):
        return logging.LogRecord(logger.name, logging.WARNING, __file__, 1, msg, (), None)

    assert not f.filter(rec("Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. "
                            "Please make sure you already `pip install kernels` and the kernels >= 0.11.1"))
    assert f.filter(rec("some other bitsandbytes warning"))
