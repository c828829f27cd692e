"""infra.device: where the engine computes. These tests run the CPU path CI has; the same calls put a decoder
layer and a batch on a GPU where torch sees one (`hf.stream.SequentialModel(device=)`)."""

from __future__ import annotations

import pytest
import torch

from ffnquant.cli import main
from ffnquant.errors import FFNQuantError
from ffnquant.infra.device import current_device, module_copy, resolve_device, to_device, use_device

NO_CUDA = not torch.cuda.is_available()


@pytest.mark.parametrize("text, want", [("cpu", "cpu"), ("CPU", "cpu"), (" auto ", "cuda" if not NO_CUDA else "cpu"),
                                        (torch.device("cpu"), "cpu")],
                         ids=["cpu", "upper", "auto", "torch-device"])
def test_a_device_resolves(text, want):
    assert resolve_device(text).type == want


@pytest.mark.parametrize("text", ["gpu", "", "cuda:x", "tpu:0", 3, None], ids=["gpu", "empty", "cuda-x", "tpu", "int", "none"])
def test_an_unknown_device_is_one_line_naming_the_valid_ones(text):
    with pytest.raises(FFNQuantError, match=r"device must be one of auto, cpu, cuda \(or cuda:N\)") as info:
        resolve_device(text)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not NO_CUDA, reason="torch sees a CUDA device here")
@pytest.mark.parametrize("text", ["cuda", "cuda:1"], ids=["cuda", "cuda-1"])
def test_cuda_without_cuda_is_refused_never_run_on_the_cpu(text):
    with pytest.raises(FFNQuantError, match="use --device cpu"):
        resolve_device(text)


def test_use_device_sets_the_engines_device_for_its_duration_only():
    assert current_device().type == "cpu"
    with use_device("cpu") as device:
        assert current_device() == device == torch.device("cpu")
    with pytest.raises(FFNQuantError):
        with use_device("gpu"):
            pass
    assert current_device().type == "cpu"


def test_module_copy_is_a_copy_with_the_same_values_and_grad_flags_and_leaves_the_module():
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    module[0].bias.requires_grad_(False)
    copied = module_copy(module, torch.device("cpu"))
    for (name, a), (_, b) in zip(module.state_dict(keep_vars=True).items(), copied.state_dict(keep_vars=True).items()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
        assert a.requires_grad == b.requires_grad, name
    with torch.no_grad():
        copied[0].weight.zero_()
    assert module[0].weight.abs().sum() > 0


def test_to_device_moves_every_tensor_in_nested_calls_and_keeps_the_rest():
    Pair = __import__("collections").namedtuple("Pair", "a b")
    value = ((torch.ones(2), 3), {"mask": torch.zeros(1), "cache": None, "list": [torch.ones(1)]}, Pair(1, 2), "x")
    got = to_device(value, torch.device("cpu"))
    assert got[0][0] is value[0][0] and got[0][1] == 3  # already there: the same tensor, no copy
    assert got[1]["cache"] is None and got[1]["list"][0] is value[1]["list"][0] and got[2] == Pair(1, 2)
    assert got[3] == "x"


@pytest.mark.skipif(not NO_CUDA, reason="torch sees a CUDA device here")
@pytest.mark.parametrize("argv", [
    ["plan", "--model", "no-such-folder", "--device", "cuda"],
    ["quantize", "--model", "no-such-folder", "--device", "cuda"],
    ["model", "eval", "no-such-folder", "--device", "cuda"],
    ["profile", "--model", "no-such-folder", "--device", "cuda"],
    ["export", "--model", "no-such-folder", "--plan", "p.toml", "--out", "o", "--device", "cuda"],
], ids=["plan", "quantize", "model-eval", "profile", "export"])
def test_each_model_command_refuses_cuda_here_before_reading_the_model(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("this torch has no CUDA build" in err[0] or "sees no CUDA device" in err[0])


@pytest.mark.hf
def test_the_engine_on_an_explicit_cpu_device_computes_what_the_default_does(tmp_path_factory):
    """The device path (each batch, call and head moved to the engine's device and back) changes no value."""
    from hf_models import tiny_folders

    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel

    folder = tiny_folders(tmp_path_factory, ("llama",))["llama"][0]
    info = inspect_model(folder)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    outs = []
    for engine in (SequentialModel(info, resident=False), SequentialModel(info, resident=True, device=torch.device("cpu"))):
        store = _Store(None, "text")
        calls = engine.embed([ids], store)
        for j in range(len(engine.layers)):
            with engine.layer(j):
                engine.run(j, store, calls)
        outs.append(engine.head_out(store.get(0))[1])
    assert engine.device == torch.device("cpu") and torch.equal(outs[0], outs[1])
