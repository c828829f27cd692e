"""Which backend can take a recipe, and why not: one registry that bench, plan and export ask.

A backend is anything a quantized FFN goes to: the per-FFN ONNX artifact writer (`onnx-artifact`), the
deployment formats (`compressed-tensors`, `onnx-graph`) and every runtime (`ort-cpu`, `torch-cuda-graph`,
`triton-cuda`, ...). Each declares one decision, `(recipe, spec) -> Support`: what it makes of the recipe (an
artifact kind, a kernel format) or the one-line reason it cannot, decided from the recipe alone, before anything
is quantized. `supports(backend, recipe, spec)` asks it.

The artifact writer and compressed-tensors decide here, from the scheme's numbers. The whole-model graph and the
runtimes decide in their own modules (the graph's rewrite rules, a runtime's probed kernels), which register
themselves here when imported; `PROVIDERS` names those modules, imported the first time a name is asked that is not
registered yet.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .errors import FFNQuantError, unknown_choice
from .methods import handler_for
from .recipe import Recipe, as_recipe
from .schemes import ActDType, ActMode, Granularity, Method, Scheme, WeightDType, get_scheme

if TYPE_CHECKING:  # annotations only
    from .spec import FFNSpec

__all__ = ["supports_subject", "Support", "Backend", "register_backend", "unregister_backend", "backend_names", "get_backend", "supports", "artifact_kind",
           "ARTIFACT_KINDS", "CTENSORS_SUPPORTED", "ASYMMETRIC_INT4_MEASURED", "ASYMMETRIC_INT4_WHY", "ROTATE_WHY"]


@dataclass(frozen=True)
class Support:
    """A backend's answer for one recipe: `kind` (what it becomes: 'qdq', 'nbits', a runtime's format...) and a
    note saying how, or `kind` None and `why` the one-line reason it cannot."""

    backend: str
    recipe: str
    kind: str | None
    note: str

    @property
    def ok(self) -> bool:
        return self.kind is not None

    @property
    def why(self) -> str | None:
        return None if self.ok else self.note


@dataclass(frozen=True)
class Backend:
    """A registered backend: its name, one line on what it is, and its decision."""

    name: str
    what: str
    decide: Callable[[Any, Any], tuple[str | None, str]]


_BACKENDS: dict[str, Backend] = {}
# The modules that register backends deciding in a higher layer (the whole-model graph, every runtime) when they
# are imported: imported, in this order, the first time a name is asked that is not registered yet.
PROVIDERS = ("ffnquant.deploy.onnx_model", "ffnquant.runtimes", "ffnquant.deploy.vllm")


def register_backend(name: str, what: str, decide: Callable[[Any, Any], tuple[str | None, str]]) -> Backend:
    """Declare backend `name`: `decide(recipe, spec)` returns (kind, note) or (None, why); spec may be None when
    the question is about the scheme alone."""
    backend = Backend(name, what, decide)
    _BACKENDS[name] = backend
    return backend


def unregister_backend(name: str) -> None:
    """Remove a backend registered by `register_backend` (a plug-in's, a test's)."""
    _BACKENDS.pop(str(name).strip().lower(), None)


def _load_providers() -> None:
    for module in PROVIDERS:
        importlib.import_module(module)


def backend_names() -> list[str]:
    """Every backend, those registered by the provider modules included."""
    _load_providers()
    return sorted(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend called `name` (importing the modules that declare the others on a miss); an unknown name lists
    them."""
    key = str(name).strip().lower()
    if key not in _BACKENDS:
        _load_providers()
    if key not in _BACKENDS:
        raise unknown_choice("backend", name, sorted(_BACKENDS))
    return _BACKENDS[key]


def supports(backend: str, recipe: Any, spec: Any = None) -> Support:
    """Whether `backend` takes `recipe` (a Recipe, its text, a preset name or a Scheme) on an FFN of `spec`."""
    if isinstance(recipe, Scheme):
        subject, text = recipe, recipe.name
    else:
        subject = as_recipe(recipe) if isinstance(recipe, (Recipe, str)) else recipe
        text = str(subject)
    kind, note = get_backend(backend).decide(subject, spec)
    return Support(backend, text, kind, note)


def supports_subject(subject: Any) -> Any:
    """A Recipe from what `supports` passes a decision (a Scheme becomes the recipe of its preset name)."""
    return Recipe(subject.name) if isinstance(subject, Scheme) else subject


def _scheme(subject: Any) -> Scheme:
    return subject if isinstance(subject, Scheme) else subject.resolve()


# --- the per-FFN ONNX artifact (`onnxquant`) ----------------------------------------------------------------

ARTIFACT_KINDS = ("fp32", "fp16", "qdq", "nbits", "bnb4")


def artifact_kind(scheme: Scheme) -> tuple[str | None, str]:
    """('qdq' | 'nbits' | 'bnb4' | 'fp16' | 'fp32' | None, reason) for a scheme's ONNX artifact."""
    wd = scheme.weight_dtype
    if wd is WeightDType.FP32:
        return "fp32", "the fp32 export itself"
    if wd is WeightDType.FP16:
        return "fp16", "the fp16 export"
    if wd is WeightDType.INT8:
        if scheme.act_mode is ActMode.DYNAMIC:
            return None, "onnxruntime's DynamicQuantizeLinear is per tensor; the per-token reference has no QDQ equivalent"
        try:
            handler = handler_for(scheme)
        except FFNQuantError as exc:
            return None, str(exc)
        if not handler.on_grid:
            return None, f"int8 {scheme.method} weights have no integer grid to write"
        return "qdq", "QDQ with ffnquant's calibrated scales"
    if wd is WeightDType.INT4:
        if scheme.act_dtype is not ActDType.NONE:
            return None, "MatMulNBits takes float activations"
        if scheme.weight_granularity is Granularity.PER_TENSOR:
            return None, "MatMulNBits quantizes in blocks, not per tensor"
        return "nbits", "MatMulNBits (onnxruntime contrib op)"
    if wd in (WeightDType.NF4, WeightDType.FP4):
        return "bnb4", "MatMulBnb4 (onnxruntime contrib op, bitsandbytes' 4-bit formats)"
    return None, f"{wd.value} has no onnxruntime CPU kernel; measured in torch only"


register_backend("onnx-artifact", "one FFN as a quantized ONNX file (QDQ int8, MatMulNBits, MatMulBnb4), scored on "
                 "onnxruntime", lambda subject, spec: artifact_kind(_scheme(subject)))


# --- compressed-tensors (`deploy.ctensors`) -----------------------------------------------------------------

CTENSORS_SUPPORTED = (
    "int8 weights per channel with static or per-token int8 activations (w8a8, w8a8-s8, w8a8-dynamic, "
    "w8a8-dynamic-s8) or float activations (w8a16); 4-bit group weights whose group divides the input "
    "width (w4a16-gN, -gptq; asymmetric -asym and -awq as blocks [1, group], which transformers loads and "
    "vLLM does not); fp8 (fp8-e4m3, -pc, -dynamic); +smooth and AWQ's scales folded into the norms; "
    "+float=SITE and fp32 kept float")
# Asymmetric 4-bit groups (AWQ, -asym): compressed-tensors' group layout ("pack-quantized" with the zero points
# packed eight to an int32 along the output rows, what vLLM reads) does not load back in transformers, whose
# from_pretrained compresses its empty model before loading without packing them. The one layout that loads is
# the same codes in blocks of one row by a group (strategy "block", zero points unpacked, [out, groups]): that is
# what the writer stores (tests/test_deploy_ctensors.py loads it). vLLM takes 4-bit weights as group or channel
# only, so such a folder serves in transformers, not vLLM. Asymmetric per-channel 4-bit has no loading layout.
ASYMMETRIC_INT4_MEASURED = {"compressed-tensors": "0.20.1", "transformers": "5.24.0"}
ASYMMETRIC_INT4_WHY = (
    "asymmetric 4-bit per-channel weights do not load back: compressed-tensors {compressed-tensors} packs "
    "weight_zero_point eight to an int32 ([out/8, 1]), which transformers {transformers}'s from_pretrained builds "
    "unpacked and stops on (weight_zero_point MISMATCH); asymmetric groups are written as blocks [1, group], "
    "which load").format_map(ASYMMETRIC_INT4_MEASURED)
ROTATE_WHY = ("+rotate multiplies the hidden activation by a block-Hadamard at run time, an operation, not a "
               "weight fold, which a compressed-tensors folder loaded by transformers does not run")


def _ctensors(subject: Any, spec: FFNSpec) -> tuple[str | None, str]:
    scheme = get_scheme(subject.scheme) if not isinstance(subject, Scheme) else subject
    why = None
    if getattr(subject, "rotate", False):
        why = ROTATE_WHY
    elif scheme.weight_dtype in (WeightDType.NF4, WeightDType.FP4):
        why = f"{scheme.weight_dtype} is bitsandbytes' code book, which compressed-tensors has no layout for"
    elif scheme.method is Method.HQQ:
        why = "HQQ fits float zero points; compressed-tensors stores integer zero points"
    elif scheme.outlier_threshold is not None or scheme.no_reference_reason is not None:
        why = "a runtime-only format without ffnquant reference numerics"
    elif scheme.weight_dtype is WeightDType.INT4 and not scheme.weight_symmetric and \
            scheme.weight_granularity is not Granularity.PER_GROUP:
        why = ASYMMETRIC_INT4_WHY
    elif scheme.weight_dtype is WeightDType.INT4 and scheme.weight_granularity is Granularity.PER_GROUP and spec:
        bad = [f"{n} {d}" for n, d in (("d_model", spec.d_model), ("d_ff", spec.d_ff)) if d % scheme.group_size]
        if bad:
            why = (f"group {scheme.group_size} does not divide {' or '.join(bad)}; compressed-tensors groups must "
                   "divide the input width")
    if why is None:
        return "compressed-tensors", "the FFN Linear modules as compressed-tensors data"
    return None, f"recipe {subject} cannot be written as compressed-tensors: {why}. Supported: {CTENSORS_SUPPORTED}"


register_backend("compressed-tensors", "a Hugging Face folder whose FFN Linear modules carry compressed-tensors "
                 "data (what transformers and vLLM load)", _ctensors)
