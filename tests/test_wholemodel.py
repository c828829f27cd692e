"""The whole-model Python API (`ffnquant.wholemodel`): plan -> apply -> save -> reload, on a folder and on a
transformers model object; the README's example runs as written, on a tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

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
