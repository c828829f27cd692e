"""The whole-model Python API (`ffnquant.wholemodel`): plan -> apply -> save -> reload, on a folder and on a
transformers model object; the README's example runs as written, on a tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import ffnquant
from ffnquant.errors import FFNQuantError
from hf_models import tiny_folders

pytestmark = pytest.mark.hf
pytest.importorskip("compressed_tensors", reason="compressed-tensors not installed (pip install '.[deploy]')")

README = Path(__file__).resolve().parents[1] / "README.md"
SMALL = dict(calib_tokens=256, eval_tokens=128, seq_len=32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return tiny_folders(tmp_path_factory, ("llama",))["llama"][0]


def _readme_example() -> str:
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```python\n(import ffnquant, transformers\n.*?)```", text, re.S)
    assert block, "the README's whole-model example is gone"
    return block.group(1)


def test_the_readme_example_runs_as_written(llama, tmp_path, capsys):
    code = _readme_example()
    assert len(code.strip().splitlines()) < 10  # plan -> apply -> save -> reload in under ten lines
    out = tmp_path / "ffnq"
    # the same lines, on the tiny model, with the test's small token budgets (the defaults read 4,096 tokens)
    code = re.sub(r'MODEL, OUT = .*\n', f'MODEL, OUT = {str(llama)!r}, {str(out)!r}\n', code)
    code = code.replace('format="compressed-tensors")', 'format="compressed-tensors", candidates="fp32,w8a16,w4a16-g32", '
                        'calib_tokens=256, eval_tokens=128, seq_len=32, probe_tokens=64, rounds=2)')
    code = code.replace("ffnquant.apply(MODEL, plan)", "ffnquant.apply(MODEL, plan, calib_tokens=256, eval_tokens=128, "
                        "seq_len=32)")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert capsys.readouterr().out.startswith("True ")  # proven, then the weight bytes
    report, model = scope["report"], scope["model"]
    assert report.proven and report.path == out and report.format == "compressed-tensors"
    doc = json.loads((out / "ffnquant-deploy.json").read_text())
    assert doc["proof"]["proven"] and doc["plan"]["layers"] == scope["plan"].to_dict()["layers"]
    assert type(model).__name__ == "LlamaForCausalLM"


@pytest.mark.parametrize("recipe, reads", [("w8a8-dynamic-s8", False), ("w8a8", True)], ids=["per-token", "static"])
def test_a_plan_reading_no_calibration_runs_one_sequence_of_it_and_quantizes_the_same(llama, recipe, reads,
                                                                                      monkeypatch):
    """`apply` of recipes that read no calibration text (`Recipe.reads_calibration`) runs one sequence of it, not the
    budget: the quantized FFNs are those a full-budget capture gives (bit for bit); a static recipe reads it all."""
    from ffnquant.deploy.planned import build_planned_model

    qmodel = ffnquant.apply(llama, recipe, **SMALL, progress=False)
    budget = qmodel.settings["token_budgets"]["calibration"]
    assert qmodel.settings["calibration_read"] is reads
    assert budget["obtained"] == (256 if reads else 32)
    if reads:
        return
    from ffnquant.recipe import Recipe

    monkeypatch.setattr(Recipe, "reads_calibration", property(lambda self: True))  # the whole budget read
    forced = build_planned_model(qmodel.info, qmodel.plan, calib_tokens=256, eval_tokens=128, seq_len=32)
    assert forced.settings["token_budgets"]["calibration"]["obtained"] == 256
    x = torch.randn(16, qmodel.info.spec.d_model, generator=torch.Generator().manual_seed(0))
    for label, q in qmodel.qffns.items():
        with torch.no_grad():
            assert torch.equal(q(x), forced.qffns[label](x)), label


def test_a_model_object_and_one_recipe_for_every_layer(llama, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)  # its tokenizer is read from that folder
    qmodel = ffnquant.apply(model, "w8a16", **SMALL)
    assert {str(r) for r in qmodel.plan.layers.values()} == {"w8a16"}
    scratch = Path(qmodel.info.path)
    assert scratch != llama and scratch.is_dir()  # the model object was saved for the engine to read
    report = ffnquant.save(qmodel, tmp_path / "out")
    assert report.proven and (tmp_path / "out" / "config.json").is_file()
    with pytest.raises(FFNQuantError, match="exists and is not empty"):
        ffnquant.save(qmodel, tmp_path / "out")  # never over a folder this call did not write
    del qmodel
    import gc

    gc.collect()
    assert not scratch.exists()  # the scratch copy goes with the model


@pytest.mark.parametrize("call, message", [
    (lambda m: ffnquant.apply(m, 3.5), "expected a Plan, a plan.toml path or a recipe"),
    (lambda m: ffnquant.apply(m, "w9a9"), "w9a9"),
    (lambda m: ffnquant.apply(m, "w8a16", format="gguf"), "gguf"),
    (lambda m: ffnquant.apply(object(), "w8a16"), "expected a model folder or a transformers model"),
    (lambda m: ffnquant.save(object(), "x"), "save takes the model ffnquant.apply returns"),
    (lambda m: ffnquant.plan(m, "ppl<1%"), "ppl+P%"),
    (lambda m: ffnquant.plan(m, objective="bytes", runtime="torch-cpu"), "runtime torch-cpu applies to the latency"),
    (lambda m: ffnquant.plan(m, candidates="w9a9"), "w9a9"),
], ids=["not-a-plan", "unknown-recipe", "unknown-format", "not-a-model", "save-not-applied", "bad-target",
        "runtime-with-bytes", "unknown-candidate"])
def test_bad_input_is_one_line(llama, call, message):
    with pytest.raises(FFNQuantError, match=re.escape(message)) as info:
        call(llama)
    assert "\n" not in str(info.value)


# --- every argument checked before the model is read ------------------------------------------------------------
@pytest.fixture
def never_read(monkeypatch):
    """The model is never read: a check that came after reading it would fail the test here instead."""
    from ffnquant import wholemodel

    def refuse(*args, **kwargs):
        raise AssertionError("the model was read before the arguments were checked")

    monkeypatch.setattr(wholemodel, "_model_info", refuse)


@pytest.mark.parametrize("call, message", [
    (lambda: ffnquant.plan("M", max_memory="8 parsecs"), "max_memory: '8 parsecs' is not a memory size"),
    (lambda: ffnquant.plan("M", max_memory=[8]), "max_memory must be a size such as '8GB'"),
    (lambda: ffnquant.plan("M", rounds=0), "rounds must be a positive integer, got 0"),
    (lambda: ffnquant.plan("M", rounds=2.5), "rounds must be a positive integer, got 2.5"),
    (lambda: ffnquant.plan("M", probe_tokens=True), "probe_tokens must be a positive integer, got True"),
    (lambda: ffnquant.plan("M", tokens=-1), "tokens must be a positive integer, got -1"),
    (lambda: ffnquant.plan("M", decode_tokens=-1), "decode_tokens must be an integer of at least 0, got -1"),
    (lambda: ffnquant.plan("M", calib_tokens=0), "calib_tokens must be a positive integer, got 0"),
    (lambda: ffnquant.plan("M", seq_len="32"), "seq_len must be a positive integer, got '32'"),
    (lambda: ffnquant.plan("M", candidates=["fp32", 3]), "candidates must be a candidate set name, comma-separated "
                                                         "recipes, or a list of recipe texts or Recipes; it holds int 3"),
    (lambda: ffnquant.plan("M", candidates=[]), "candidates must be a candidate set name"),
    (lambda: ffnquant.plan("M", tokenizer="not a tokenizer"), "tokenizer must be None or a transformers tokenizer"),
    (lambda: ffnquant.plan("M", text=b"some text"), "text must be a file path or shipped corpus name"),
    (lambda: ffnquant.plan("M", eval_text=["a.txt", None]), "eval_text must be a file path or shipped corpus name"),
    (lambda: ffnquant.plan("M", target=1.01), "target must be a target text such as 'ppl+1%'"),
    (lambda: ffnquant.plan("M", format=3), "format must be 'compressed-tensors', 'onnx' or None"),
    (lambda: ffnquant.plan("M", ort_floor="no"), "ort_floor must be True or False, got 'no'"),
    (lambda: ffnquant.plan("M", sequential=1), "sequential must be True or False or None, got 1"),
    (lambda: ffnquant.plan("M", progress="yes"), "progress must be True (lines on stderr), False (silent) or a callable"),
    (lambda: ffnquant.apply("M", "w8a16", progress=1), "progress must be True (lines on stderr), False (silent) or a callable"),
    (lambda: ffnquant.apply("M", "w8a16", eval_tokens=0), "eval_tokens must be a positive integer, got 0"),
    (lambda: ffnquant.apply("M", "w8a16", text=b"x"), "text must be a file path or shipped corpus name"),
    (lambda: ffnquant.apply("M", "w8a16", tokenizer=42), "tokenizer must be None or a transformers tokenizer"),
    (lambda: ffnquant.apply("M", "w8a16", format=None), "format must be 'compressed-tensors' or 'onnx'"),
    (lambda: ffnquant.apply("M", 3.5), "plan_or_recipe: expected a Plan, a plan.toml path or a recipe"),
    (lambda: ffnquant.save(object(), None), "out must be a folder path (a non-empty str or pathlib.Path), got None"),
    (lambda: ffnquant.save(object(), ""), "out must be a folder path"),
    (lambda: ffnquant.save(object(), "x", force="yes"), "force must be True or False, got 'yes'"),
    (lambda: ffnquant.save(object(), "x", progress=1), "progress must be True (lines on stderr), False (silent)"),
    (lambda: ffnquant.plan("M", device="gpu"), "device must be one of auto, cpu, cuda (or cuda:N), got 'gpu'"),
    (lambda: ffnquant.apply("M", "w8a16", device=3), "device must be one of auto, cpu, cuda (or cuda:N), got 3"),
], ids=["max-memory-unit", "max-memory-list", "rounds-0", "rounds-float", "probe-tokens-bool", "tokens-negative",
        "decode-tokens-negative", "calib-tokens-0", "seq-len-str", "candidates-int", "candidates-empty",
        "tokenizer-str", "text-bytes", "eval-text-none-item", "target-float", "format-int", "ort-floor-str",
        "sequential-int", "plan-progress-str", "apply-progress-int", "apply-eval-tokens-0", "apply-text-bytes",
        "apply-tokenizer-int", "apply-format-none", "apply-not-a-plan", "save-out-none", "save-out-empty",
        "save-force-str", "save-progress-int", "plan-device-gpu", "apply-device-int"])
def test_each_argument_is_refused_in_one_line_before_the_model_is_read(never_read, call, message):
    with pytest.raises(FFNQuantError, match=re.escape(message)) as info:
        call()
    assert "\n" not in str(info.value)


def test_max_memory_takes_the_command_lines_sizes(never_read):
    from ffnquant.commands.common import memory_size
    from ffnquant.wholemodel import check_plan_arguments

    assert check_plan_arguments(max_memory="8GB") == memory_size("8GB") == 8 * 10**9
    assert check_plan_arguments(max_memory="1.5GiB") == int(1.5 * 2**30)
    assert check_plan_arguments(max_memory=4096) == 4096
    assert check_plan_arguments() is None


# --- SIGTERM inside the API leaves no staging or scratch folder ---------------------------------------------------
_CHILD = r'''
import os, signal, sys, tempfile, time
from pathlib import Path
import ffnquant
from ffnquant import wholemodel as W

which, out, source = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
before = signal.getsignal(signal.SIGTERM)

def stall(folder):
    (Path(folder) / "model.safetensors").write_bytes(b"x" * 4096)
    print("writing", flush=True)
    time.sleep(60)

class Info:
    path = source

class QModel:
    info = Info()
    settings = {"format": {"name": "compressed-tensors", "whole": True, "graph_why": None}}

if which == "save":
    W.write_deployment = lambda planned, folder, *a, **k: stall(folder)
    call = lambda: ffnquant.save(QModel(), out)
else:  # apply on a model object: its scratch copy is made first
    made = []

    def scratch_info(model, tokenizer):
        made.append(Path(tempfile.mkdtemp(prefix="ffnquant-model-")))
        return Info(), made[-1]
    W._model_info = scratch_info
    W.model_fingerprint = lambda info: stall(made[-1])  # the first step after the copy
    call = lambda: ffnquant.apply(object(), "w8a16")
try:
    call()
except KeyboardInterrupt as exc:
    print("interrupted", getattr(exc, "signum", None), signal.getsignal(signal.SIGTERM) == before, flush=True)
    sys.exit(3)
'''


@pytest.mark.parametrize("which", ["save", "apply"])
def test_sigterm_inside_the_api_leaves_no_staging_folder(tmp_path, which):
    """A service stopping the process (SIGTERM) while `save` writes or `apply` holds its scratch copy: the call
    unwinds like Ctrl-C, nothing is left beside the output or in the temporary folder, the handler is restored."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(_CHILD, encoding="utf-8")
    work, tmp, source = tmp_path / "work", tmp_path / "tmp", tmp_path / "source"
    for d in (work, tmp, source):
        d.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                                         os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, str(script), which, str(work / "out"), str(source)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing", proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 3, err
    assert out.strip() == f"interrupted {int(signal.SIGTERM)} True"
    assert os.listdir(work) == [] and os.listdir(tmp) == []
