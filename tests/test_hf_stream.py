"""hf.stream: the engine, resident or reading a decoder layer at a time, gives the figures of transformers' own
whole-model forward bit for bit.

Every mode runs the same float32 modules on the same batches (the decoder layers called with the arguments the
model's own forward builds), so every comparison here is exact equality: histogram counts, minima and maxima,
per-layer SQNR, perplexities. The reference is the whole-model path encoders still take (`calibrate_model`,
`capture_layer_inputs` + `quantize_model_layers`), which runs the model's forward in one call.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ffnquant.errors import FFNQuantError

from hf_models import tiny_folders

pytestmark = pytest.mark.hf

# Every architecture sequential onloading takes. gemma: a tied LM head, embeddings scaled inside the embedding
# module, (1 + w) RMSNorms; gpt2: learned positions, blocks under transformer.h, a tied head; phi3: fused gate+up.
ARCHS = ("llama", "mistral", "qwen2", "gemma", "phi3", "gpt2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return {name: folder for name, (folder, _, _) in tiny_folders(tmp_path_factory, ARCHS + ("bert",)).items()}


def _settings(**kw):
    from ffnquant.hf import EvalSettings

    return EvalSettings(seq_len=16, batch_size=4, max_calib_tokens=128, max_eval_tokens=64, **kw)


def _without_seconds(data):
    """The data with timings left out: the only figures the two paths do not share."""
    if isinstance(data, dict):
        return {k: _without_seconds(v) for k, v in data.items() if k != "seconds"}
    if isinstance(data, list):
        return [_without_seconds(v) for v in data]
    return data


@pytest.mark.parametrize("name, layers, resident", [("llama", "all", False), ("gemma", "all", False),
                                                    ("gpt2", "all", False), ("llama", "0", False),
                                                    ("gemma", "all", True)],
                         ids=["llama", "gemma", "gpt2", "llama-first-layer-only", "gemma-resident"])
def test_engine_ranges_and_positions_equal_the_whole_forward_ones(tiny, name, layers, resident):
    from ffnquant.hf.layerwise import model_top_positions
    from ffnquant.hf import calibrate_model, inspect_model
    from ffnquant.hf.layerwise import calibrate_layerwise

    info = inspect_model(tiny[name])
    hf_layers, tables = calibrate_model(info, layers=layers, settings=_settings())
    top, measured = model_top_positions(info, hf_layers, settings=_settings())
    s_tables, s_top, s_measured = calibrate_layerwise(info, layers, settings=_settings(), resident=resident)
    assert list(s_tables) == list(tables) and tables
    for label, table in tables.items():
        for site, obs in table.items():
            got = s_tables[label][site]
            assert np.array_equal(got.histogram.counts, obs.histogram.counts), (label, site)
            assert (got.min, got.max) == (obs.min, obs.max), (label, site)
        assert s_tables[label].to_dict() == table.to_dict()  # every observer's state and the meta
    assert s_top == top and s_measured == measured


@pytest.mark.parametrize("name, layers, mode, plan", [(name, "all", "streamed", False) for name in ARCHS] + [
    ("llama", "all", "spilled", False), ("llama", "1", "streamed", False), ("llama", "all", "streamed", True),
    ("llama", "all", "resident", False), ("gpt2", "all", "resident", True)],
    ids=list(ARCHS) + ["llama-spilled-to-disk", "llama-second-layer-only", "llama-plan", "llama-resident",
                       "gpt2-resident-plan"])
def test_engine_quantize_equals_the_whole_forward_report(tiny, tmp_path, name, layers, mode, plan):
    """Per-layer rows (SQNR, ranges, sensitivity), the end-to-end perplexity and final hidden SQNR, the per-layer
    ablation: `quantize_layerwise` returns `quantize_model_layers`' data exactly, the model resident or read a
    layer at a time, hidden states in memory or on disk, one recipe or a plan's recipe per layer."""
    from ffnquant.hf import capture_layer_inputs, inspect_model, load_ffn_layers, quantize_model_layers
    from ffnquant.hf.layerwise import quantize_layerwise
    from ffnquant.planning.planfile import Plan, model_fingerprint
    from ffnquant.recipe import as_recipe

    info, recipe, settings = inspect_model(tiny[name]), as_recipe("w8a8"), _settings()
    if plan:
        recipe = Plan(model_fingerprint(info), {0: as_recipe("w8a16"), 1: as_recipe("w8a8@mse+smooth")})
    hf_layers = load_ffn_layers(info, layers)
    inputs = capture_layer_inputs(info, hf_layers, calib_tokens=128, eval_tokens=64, settings=settings, whole=True)
    want = quantize_model_layers(info, hf_layers, inputs, recipe, onnx=False, settings=settings)
    got = quantize_layerwise(info, recipe, layers, calib_tokens=128, eval_tokens=64, settings=settings, onnx=False,
                             resident=mode == "resident", spill=mode == "spilled", spill_dir=tmp_path)
    assert [r["accuracy_torch"]["sqnr_db"] for r in got["layers"]] == [r["accuracy_torch"]["sqnr_db"]
                                                                         for r in want["layers"]]
    assert got["end_to_end"]["end_to_end"]["perplexity"] == want["end_to_end"]["end_to_end"]["perplexity"]
    assert len(got["end_to_end"]["ablation"]) == (2 if layers == "all" else 0)
    assert json.dumps(_without_seconds(got), sort_keys=True, default=str) == \
        json.dumps(_without_seconds(want), sort_keys=True, default=str)
    assert list(tmp_path.iterdir()) == []  # the spilled hidden states are gone


@pytest.mark.parametrize("name, resident", [("llama", False), ("gemma", False), ("phi3", False), ("gpt2", True)],
                         ids=["llama", "gemma", "phi3-fused", "gpt2-resident"])
def test_a_bf16_engine_computes_what_transformers_computes_in_bf16(tiny, name, resident):
    """The engine computing in bf16, as a runtime serves a bf16 checkpoint: every FFN gets, bit for bit, the input
    transformers' whole forward in bf16 gives it (captured as float32 values), and the logits are the same; the
    checks on each layer pass, as they run on a float32 copy of it."""
    from ffnquant.hf import inspect_model, load_ffn_layers
    from ffnquant.hf.capture import ffn_input_hooks, load_hf_model
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel

    info = inspect_model(tiny[name])
    engine = SequentialModel(info, resident=resident, dtype=torch.bfloat16)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    store = _Store(None, "text")
    calls = engine.embed([ids], store)
    layers = load_ffn_layers(info, "all")
    captured: dict = {}
    for j in range(len(engine.layers)):
        with engine.layer(j):
            engine.check(j, store, calls, [layer for layer in layers if layer.index == j])
            engine.run(j, store, calls, capture=captured)
    _, logits = engine.head_out(store.get(0))
    model = load_hf_model(info, dtype=torch.bfloat16)
    whole: dict = {}
    with torch.no_grad(), ffn_input_hooks(model, info, list(info.layers), lambda l, x: whole.setdefault(l.label, x)):
        want = model(ids).logits
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, want)
    assert set(captured) == set(whole) and whole
    for label, x in whole.items():
        assert captured[label][0].dtype == torch.float32 and torch.equal(captured[label][0], x), label


def test_only_one_decoder_layer_is_ever_in_memory(tiny):
    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel

    info = inspect_model(tiny["llama"])
    model = SequentialModel(info)
    assert all(p.is_meta for p in model.model.parameters())  # the skeleton holds no weights
    store = _Store(None, "calibration")
    calls = model.embed([torch.randint(4, 90, (2, 16))], store)
    model.offload(model.embedding)
    for j in range(len(model.layers)):
        with model.layer(j):
            resident = {i for i, block in enumerate(model.layers) if not any(p.is_meta for p in block.parameters())}
            assert resident == {j}
            model.run(j, store, calls)
    assert all(p.is_meta for block in model.layers for p in block.parameters())
    assert store.get(0).shape == (2, 16, info.spec.d_model)
    with model.layer(1, ffn=False) as block:  # a replacement computes in its FFN's place: the FFN is not read
        ffn = {id(p) for p in model.ffns[1].parameters()}
        assert ffn and all(p.is_meta == (id(p) in ffn) for p in block.parameters())
    assert all(p.is_meta for p in model.layers[1].parameters())
    whole = SequentialModel(info, resident=True)  # every layer stays, whatever the calls
    with whole.layer(0, ffn=False):
        whole.offload(whole.embedding)
    assert not any(p.is_meta for p in whole.model.parameters())


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "streamed"])
def test_freed_memory_is_kept_for_the_next_layer_only_when_the_model_is_resident(tiny, monkeypatch, resident):
    """Resident (the model fits), glibc keeps freed blocks up to 32 MB and 1 GB of freed heap top: fresh pages cost
    kernel time on every first touch. Streamed, blocks from 4 MB up are mapped on their own, glibc's default trim
    threshold holds again (a resident model may have raised it earlier in the process), and each layer's freed
    memory is handed back (`release`), which bounds the peak."""
    from ffnquant.hf import inspect_model, spill, stream

    calls = []
    monkeypatch.setattr(spill, "_glibc", lambda call, *args: calls.append((call, *args)))
    model = stream.SequentialModel(inspect_model(tiny["llama"]), resident=resident)
    set_up = [c for c in calls if c[0] == "mallopt"]
    calls.clear()
    model.release()
    if resident:
        assert set_up == [("mallopt", -3, 32 * 2**20), ("mallopt", -1, 2**30)] and calls == []
    else:
        assert set_up == [("mallopt", -3, 4 * 2**20), ("mallopt", -1, 128 * 2**10)] and calls == [("malloc_trim", 0)]


def test_a_checkpoint_transformers_does_not_rename_keeps_its_stored_names(tiny):
    """`_Weights.rename_as_loaded` adds names only where transformers' conversion mapping renames a stored tensor:
    a Llama's names are its own, and every read answers as before."""
    from ffnquant.hf.weights import _Weights

    weights = _Weights(Path(tiny["llama"]), False)
    assert weights.rename_as_loaded("llama") is False and not weights.renamed
    assert weights.names == sorted(weights.file_of)
    name = weights.names[0]
    assert weights.path_of(name) == weights.file_of[name] and weights.shape(name) == tuple(weights.get(name).shape)


def test_large_tensors_are_read_a_row_chunk_at_a_time(tiny, tmp_path, monkeypatch):
    """A tensor over `_READ_BYTES` is read in row chunks into its copy in the engine's dtype: the values
    `get().to(dtype)` gives, whatever the checkpoint's dtype; and a model read so streams to the in-memory path's
    ranges."""
    from safetensors.torch import save_file

    from ffnquant.hf import calibrate_model, inspect_model, stream_tensors
    from ffnquant.hf.checkpoint import _Weights
    from ffnquant.hf.layerwise import calibrate_layerwise

    gen = torch.Generator().manual_seed(0)
    tensors = {"bf16": torch.randn(37, 11, generator=gen).to(torch.bfloat16),
               "fp16": torch.randn(5, 3, 9, generator=gen).half(), "flat": torch.randn(100, generator=gen),
               "small": torch.randn(2, 3, generator=gen)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(stream_tensors, "_READ_BYTES", 64)  # 2 rows of bf16 a read, 32 elements of the flat one
    weights = _Weights(tmp_path, False)
    for name, t in tensors.items():
        for dtype in (torch.float32, torch.bfloat16):
            got = stream_tensors._read(weights, name, dtype)
            assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, t.to(dtype)), (name, dtype)
    monkeypatch.setattr(stream_tensors, "_READ_BYTES", 256)  # the tiny llama's embedding and matrices read in chunks
    info = inspect_model(tiny["llama"])
    _, tables = calibrate_model(info, settings=_settings())
    s_tables, _, _ = calibrate_layerwise(info, settings=_settings(), positions=False)
    assert {k: t.to_dict() for k, t in s_tables.items()} == {k: t.to_dict() for k, t in tables.items()}


def _plan(info, monkeypatch, **kw):
    from ffnquant.hf import memory

    monkeypatch.setattr(memory, "process_rss", lambda: 100 * 10**6)  # a fixed runtime: the estimates are exact
    needs = memory.quantize_needs(info, calib_tokens=10_000, eval_tokens=10_000, n_layers=2)
    return memory.plan_memory(info, needs, **kw)


def test_the_budget_chooses_whole_streamed_or_spilled(tiny, monkeypatch):
    from ffnquant.hf import inspect_model

    info = inspect_model(tiny["llama"])
    p = _plan(info, monkeypatch, max_memory=10**12)
    assert p.spilled < p.streamed < p.in_memory  # the kept hidden states; every layer, whole
    assert p.in_memory - p.streamed <= info.n_params_total * 4  # one engine: the modes differ in where weights are
    assert (p.sequential, p.spill) == (False, False)
    between = _plan(info, monkeypatch, max_memory=(p.streamed + p.in_memory) // 2)
    assert (between.sequential, between.spill) == (True, False) and between.peak == p.streamed
    spilled = _plan(info, monkeypatch, max_memory=(p.spilled + p.streamed) // 2)
    assert (spilled.sequential, spilled.spill) == (True, True) and "spilled to" in spilled.reason
    assert _plan(info, monkeypatch, max_memory=10**12, sequential=True).sequential
    with pytest.raises(FFNQuantError, match="even with its hidden states .* on disk") as err:
        _plan(info, monkeypatch, max_memory=p.spilled - 1)
    assert "\n" not in str(err.value) and "--calib-tokens" in str(err.value)
    with pytest.raises(FFNQuantError, match="leave out --no-sequential"):
        _plan(info, monkeypatch, max_memory=p.streamed, sequential=False)


def _on_gpu(info, monkeypatch, free, **kw):
    """The plan for a CUDA engine with `free` bytes free on the device (no GPU needed: only the estimates)."""
    from ffnquant.hf import memory

    monkeypatch.setattr(memory, "device_free_memory", lambda device: free)
    return _plan(info, monkeypatch, device="cuda", **kw)


def test_on_a_gpu_the_model_is_counted_on_the_device_and_the_kept_tensors_on_the_host(tiny, monkeypatch):
    from ffnquant.hf import inspect_model

    info = inspect_model(tiny["llama"])
    cpu = _plan(info, monkeypatch, max_memory=10**12)
    gpu = _on_gpu(info, monkeypatch, 10**12, max_memory=10**12)
    assert (gpu.sequential, gpu.spill, gpu.device) == (False, False, "cuda")
    assert cpu.device_peak is None and gpu.device_peak == gpu.device_in_memory >= info.n_params_total * 4
    # the host holds the kept hidden states, or the model while it loads: never both
    assert gpu.in_memory <= cpu.in_memory and gpu.in_memory >= 100 * 10**6 + info.n_params_total * 4
    assert "on cuda" in gpu.summary() and "in host memory" in gpu.summary()
    assert gpu.to_dict()["device_peak"] == gpu.device_in_memory


def test_on_a_gpu_too_small_for_the_whole_model_it_streams_and_says_why(tiny, monkeypatch):
    from ffnquant.hf import inspect_model

    info = inspect_model(tiny["llama"])
    full = _on_gpu(info, monkeypatch, 10**12, max_memory=10**12)
    between = (full.device_streamed + full.device_in_memory) // 2
    p = _on_gpu(info, monkeypatch, between, max_memory=10**12)
    assert p.sequential and not p.spill and p.device_peak == full.device_streamed and "on cuda" in p.reason
    with pytest.raises(FFNQuantError, match=r"free there.*use --device cpu or leave out --no-sequential") as err:
        _on_gpu(info, monkeypatch, between, max_memory=10**12, sequential=False)
    assert "\n" not in str(err.value)
    with pytest.raises(FFNQuantError, match=r"layer by layer this run needs about .* on cuda .* free there: pass fewer "
                                            r"--calib-tokens/--eval-tokens or use --device cpu"):
        _on_gpu(info, monkeypatch, full.device_streamed - 1, max_memory=10**12)


@pytest.mark.parametrize("limit, peak, want", [(None, 5, None), (100, 40, 30), (100, 120, 0)],
                         ids=["no-budget", "half-the-headroom", "over-budget"])
def test_the_rounds_keep_quantized_ffns_within_half_the_plans_headroom(limit, peak, want):
    from ffnquant.hf.memory import MemoryPlan
    from ffnquant.planning.job import offer_budget

    memory = MemoryPlan(False, False, limit, peak, 0, 0, 0, 0, 0, "test")
    assert offer_budget(memory) == want and offer_budget(None) is None


def test_models_that_cannot_stream_say_why(tiny, monkeypatch):
    from ffnquant.hf import inspect_model

    info = inspect_model(tiny["bert"])
    with pytest.raises(FFNQuantError, match="runs decoder-only causal LMs; bert is .*: it runs whole"):
        _plan(info, monkeypatch, sequential=True)
    assert not _plan(info, monkeypatch).sequential  # within the machine's memory: the whole model, as before


@pytest.mark.parametrize("command", ["quantize", "profile"])
def test_cli_refuses_a_run_that_cannot_fit_up_front(tiny, tmp_path, capsys, command):
    from ffnquant.cli import main

    out = tmp_path / "out"
    argv = {"quantize": ["quantize", "--out-reports", str(out / "r"), "--out-artifacts", str(out / "e")],
            "profile": ["profile", "--out", str(out)]}[command]
    assert main(argv + ["--model", str(tiny["llama"]), "--max-memory", "1MB"]) == 2
    err = capsys.readouterr().err.strip()
    flag = "--calib-tokens" if command == "quantize" else "--model-tokens"
    assert err.count("\n") == 0 and "over the 1.0 MB memory budget" in err and f"pass fewer {flag}" in err
    assert not out.exists()  # refused before any work or output


def test_cli_sequential_writes_the_in_memory_report(tiny, tmp_path, capsys):
    from ffnquant.cli import main

    reports = {}
    for mode in ("--sequential", "--no-sequential"):
        out = tmp_path / mode
        assert main(["quantize", "--model", str(tiny["gemma"]), "--calib-tokens", "128", "--eval-tokens", "64",
                     "--no-onnx", "--no-progress", mode, "--out-reports", str(out)]) == 0
        assert f"memory: {'layer by layer' if mode == '--sequential' else 'whole model in memory'} ({mode})" in \
            capsys.readouterr().out
        data = json.loads(next(out.glob("quantize_*.json")).read_text())
        assert data.pop("memory")["sequential"] is (mode == "--sequential")
        data.pop("environment")
        reports[mode] = _without_seconds(data)
    assert reports["--sequential"] == reports["--no-sequential"]


@pytest.mark.parametrize("text, size", [("8GB", 8 * 10**9), ("8g", 8 * 10**9), ("512MB", 512 * 10**6),
                                        ("1.5GiB", 3 * 2**29), ("3e9", 3 * 10**9), ("4096", 4096), ("2 TiB", 2**41)],
                         ids=str)
def test_memory_sizes(text, size):
    from ffnquant.infra.resources import parse_size

    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "lots", "-1GB", "0", "8XB", "1e400"], ids=repr)
def test_bad_memory_sizes_are_one_line_errors(text):
    from ffnquant.infra.resources import parse_size

    with pytest.raises(FFNQuantError, match="memory size") as err:
        parse_size(text)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name, resident", [("llama", False), ("gemma", False), ("gpt2", True)],
                         ids=["llama", "gemma-tied", "gpt2-resident"])
def test_the_head_on_some_tokens_gives_those_tokens_logits(tiny, name, resident):
    """`head_out(vocab=)` (the probes' ablations) gives the whole head's logits at those tokens, up to the float32
    rounding of a matrix product of other shape, and leaves the head as it was (a tied head still tied)."""
    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel

    info = inspect_model(tiny[name])
    engine = SequentialModel(info, resident=resident)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    store = _Store(None, "text")
    calls = engine.embed([ids], store)
    for j in range(len(engine.layers)):
        with engine.layer(j):
            engine.run(j, store, calls)
    vocab = torch.tensor([0, 5, 17, 42, 88])
    final_sub, sub = engine.head_out(store.get(0), vocab=vocab)
    final, whole = engine.head_out(store.get(0))
    assert torch.equal(final_sub, final)
    assert sub.shape == (*whole.shape[:-1], 5)
    torch.testing.assert_close(sub, whole[..., vocab], rtol=1e-5, atol=1e-5)
    assert engine.head.weight.shape[0] == whole.shape[-1]
    if engine.tied:
        assert engine.head.weight is engine.embedding.weight


def test_the_probe_vocabulary_holds_the_likeliest_and_the_next_tokens():
    from ffnquant.planning.sensitivity import float_terms, probe_vocabulary

    logits = torch.randn(2, 6, 50, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(2))
    vocab = probe_vocabulary(logits, ids, k=3)
    top = logits[:, :-1].topk(3, dim=-1).indices
    assert set(top.reshape(-1).tolist()) | set(ids[:, 1:].reshape(-1).tolist()) == set(vocab.tolist())
    assert torch.equal(vocab, vocab.sort().values)
    # on the whole vocabulary the terms are the plain ones: per sequence NLL of the next tokens
    nll, p, plogp = float_terms(logits, ids)
    want = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1).double().sum(-1)
    torch.testing.assert_close(nll, want)
    sub_nll, sub_p, _ = float_terms(logits[..., vocab], ids, vocab)
    assert sub_p.shape[-1] == vocab.numel() and torch.allclose(sub_p.sum(-1), torch.ones(2, 5))
    assert torch.all(sub_nll <= nll + 1e-9)  # renormalized on fewer tokens: each next token is no less likely


@pytest.mark.parametrize("batch", [1, 3], ids=["one-sequence", "three-sequences"])
def test_a_loop_that_unpacks_each_layers_output_is_answered_as_a_tuple(tmp_path, batch):
    """Bamba's forward unpacks each decoder layer's output as (hidden, attention weights): the stand-ins' plain
    tensor then unpacks to one value for a batch of one (three for three) and the loop raised a ValueError, which read
    as transformers refusing the call. The engine answers in tuples instead and records every layer's call, with the
    embeddings transformers' own forward computes."""
    import transformers as T

    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel
    from hf_models import save_causal_tiny

    folder = save_causal_tiny(T, "bamba", tmp_path / "bamba")
    info = inspect_model(folder)
    engine = SequentialModel(info, resident=True)
    ids = torch.randint(3, 90, (batch, 16), generator=torch.Generator().manual_seed(0))
    store = _Store(None, "embedded")
    calls = engine.embed([ids], store)
    assert engine._tuple_out and len(calls[0]) == info.n_layers
    with torch.no_grad():
        want = T.AutoModelForCausalLM.from_pretrained(folder).model.embed_tokens(ids)
    assert torch.equal(store.get(0), want)


def test_a_layer_that_transformers_refuses_to_run_on_token_ids_alone_is_named_not_an_internal_error(tmp_path,
                                                                                                  monkeypatch):
    """A layer that transformers' own code refuses on what the model's forward passes it for token ids alone (Gemma 4's
    assistant, when not run through its target: `hf.draft`, left out here) was reported as a bug of ffnquant. Now one
    line naming the layer and transformers' exception, and the causal LM's own refusal of token ids alone where it has
    one; an exception from ffnquant's own code stays what it is."""
    import transformers as T

    from ffnquant.hf import inspect_model
    from ffnquant.hf import draft
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.forward import raised_in_transformers as _raised_in_transformers
    from ffnquant.hf import stream
    from ffnquant.hf.stream import SequentialModel
    from hf_models import save_causal_tiny

    monkeypatch.setattr(stream, "feed", lambda model, path, **kw: model)
    monkeypatch.setattr(draft, "require_target", lambda path: None)
    monkeypatch.setattr(draft, "feed", lambda model, path, **kw: model)
    folder = save_causal_tiny(T, "gemma4_assistant", tmp_path / "gemma4_assistant")
    info = inspect_model(folder)
    engine = SequentialModel(info, resident=True)
    ids = torch.randint(3, 90, (1, 8), generator=torch.Generator().manual_seed(0))
    store = _Store(None, "embedded")
    calls = engine.embed([ids], store)
    with pytest.raises(FFNQuantError, match=r"decoder layer 0 \(\w+\) fails on the inputs its model's forward passes "
                                            r"it for token ids alone \(KeyError: 'sliding_attention'\); its causal "
                                            r"LM's own forward refuses token ids alone \(inputs_embeds and "
                                            r"shared_kv_states cannot be None.\)"):
        engine.run(0, store, calls)
    try:
        {}["ffnquant's own"]
    except KeyError as exc:
        assert not _raised_in_transformers(exc)


@pytest.mark.parametrize("resident", [True, False], ids=["resident", "streamed"])
def test_a_loop_that_reads_each_layers_output_by_field_is_answered_in_the_layers_own_form(tmp_path, resident):
    """Reformer's reversible layers take prev_attn_output first and hidden_states by name, and return a named tuple
    (hidden_states, attn_output, ...) that its loop reads by field, handing attn_output to the next layer and
    concatenating the last pair: the stand-ins answer in that named tuple, the layers are called with their hidden
    states by name, each layer's second output is kept in the replayed streams (which hand it to the next layer and
    the model's output), and the engine's logits are
    transformers' own (its LSH attention draws its hashing at random on each forward: within 1e-5 relative)."""
    engine, logits, want = _engine_and_model_logits("reformer", tmp_path, (2, 64), resident)
    assert engine._tuple_out.__name__ == "ReformerOutput" and engine.replay
    assert torch.allclose(logits, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def _engine_and_model_logits(model_type: str, tmp_path, shape: tuple, resident: bool = True):
    """(the engine after every layer ran on one batch of `shape` token ids, its logits, transformers' own)."""
    import transformers as T

    from ffnquant.hf import inspect_model
    from ffnquant.hf.metrics import _run
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel
    from hf_models import tiny_or_skip

    folder = tiny_or_skip(model_type, tmp_path / model_type)
    info = inspect_model(folder)
    ids = torch.randint(3, 90, shape, generator=torch.Generator().manual_seed(0))
    want = _run(T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), info, ids).logits
    engine = SequentialModel(info, resident=resident)
    store = _Store(None, "text")
    calls = engine.embed([ids], store)
    for j in range(len(engine.layers)):
        with engine.layer(j):
            engine.run(j, store, calls)
    _, logits = engine.head_out(store.get(0))
    return engine, logits, want.detach()


def test_a_reversible_model_is_planned_from_its_training_backward_and_proven_through_its_random_draws(tmp_path, capsys):
    """Reformer's layers compute under no_grad (its training backward recomputes them): plan takes the loss
    gradients from that backward, and the export of its plan is proven, the proof measuring that the original
    model's own forward draws at random (LSH hashing) and allowing those draws."""
    import json

    from ffnquant.cli import main
    from hf_models import tiny_or_skip

    folder = tiny_or_skip("reformer", tmp_path / "reformer")
    tokens = ["--calib-tokens", "256", "--eval-tokens", "128", "--seq-len", "128"]
    assert main(["plan", "--model", str(folder), "--target", "ppl+5%", "--objective", "bytes", "--candidates",
                 "fp32,w4a16-g32", *tokens, "--probe-tokens", "128", "--no-progress", "--out", str(tmp_path / "p")]) == 0
    capsys.readouterr()
    assert main(["export", "--model", str(folder), "--plan", str(tmp_path / "p" / "plan.toml"), "--format",
                 "compressed-tensors", *tokens, "--no-progress", "--out", str(tmp_path / "ct")]) == 0
    assert "the original model's forward draws at random" in capsys.readouterr().out
    proof = json.loads((tmp_path / "ct" / "ffnquant-deploy.json").read_text())["proof"]
    assert proof["proven"] and proof["load"]["allowance"]["deterministic"] is False


def test_a_forward_without_any_gradient_is_refused_by_plan_naming_it():
    """Where neither the evaluation nor the training forward carries a gradient to the FFN outputs, plan says so in
    one line naming the model (`planning.gradients.GradientPass._whole_gradients` checks the loss of each)."""
    from types import SimpleNamespace

    from ffnquant.planning.gradients import _check_differentiable

    _check_differentiable(SimpleNamespace(path="m"), torch.zeros(2, requires_grad=True).sum())
    with pytest.raises(FFNQuantError, match=r"^m: its forward computes its decoder layers without autograd") as exc:
        _check_differentiable(SimpleNamespace(path="m"), torch.zeros(2).sum())
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("model_type, order", [("dory", (0, 1, 0, 1)), ("hrm_text", (0, 1) * 6),
                                               ("inkling2_loop_text", (0, 1, 1))],
                         ids=["dory-recurrent", "hrm-cycles", "inkling2-loop-passes"])
def test_a_looped_depth_runs_each_call_as_a_layer_and_gives_the_models_logits(tmp_path, model_type, order):
    """Dory runs its recurrent section several times, HRM cycles its L stack, Inkling 2 Loop passes its last layer
    twice: each call of a decoder layer is one of ffnquant's layers, in the order the model's forward calls them
    (found when its FFNs are discovered), a later call's FFN the first call's again (`shares`). The engine runs the
    calls in order on what the forward computes between them: its logits are transformers' own, resident or read a
    layer at a time."""
    import transformers as T

    from ffnquant.hf import inspect_model
    from ffnquant.hf.metrics import _run
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel
    from hf_models import tiny_or_skip

    folder = tiny_or_skip(model_type, tmp_path / model_type)
    info = inspect_model(folder)
    assert [layer.block for layer in info.layers if layer.expert in (None, 0)] == list(order)
    first = {b: order.index(b) for b in order}
    assert [layer.shares for layer in info.layers if layer.expert in (None, 0)] == [
        None if first[b] == v else first[b] for v, b in enumerate(order)]
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    want = _run(T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), info, ids).logits.detach()
    # HRM's and Inkling's stored tensors are converted as transformers loads them: they run resident
    for resident in (True, False) if model_type == "dory" else (True,):
        engine = SequentialModel(info, resident=resident)
        store = _Store(None, "text")
        calls = engine.embed([ids], store)
        assert len(engine.layers) == len(order) and len(calls[0]) == len(order)
        for j in range(len(engine.layers)):
            with engine.layer(j):
                engine.run(j, store, calls)
        _, logits = engine.head_out(store.get(0))
        assert torch.allclose(logits, want, rtol=0, atol=1e-5 * float(want.abs().max())), resident


def test_a_stack_whose_output_reads_more_than_its_last_layer_is_replayed(tmp_path):
    """Inkling 2's final input mixes the block states it keeps (its first layer's input) into the last layer's
    output: the head cannot run from the last hidden states alone with stand-in embeddings, so the streams are
    replayed, and the engine's logits are transformers' own."""
    engine, logits, want = _engine_and_model_logits("inkling2_text", tmp_path, (2, 12))
    assert engine.replay
    assert torch.allclose(logits, want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_a_forward_that_loops_in_another_order_than_found_is_refused(tmp_path):
    """A looped depth whose order of calls was not found (or changed since) is refused on the first forward, not
    measured as another model: here Dory's model info with its order of calls taken away."""
    import dataclasses

    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel
    from hf_models import tiny_or_skip

    info = inspect_model(tiny_or_skip("dory", tmp_path / "dory"))
    arch = dataclasses.replace(info.arch, fixed={**info.arch.fixed, "calls": ()})
    blocks = [layer for layer in info.layers if layer.shares is None]
    info = dataclasses.replace(info, arch=arch, layers=tuple(blocks), n_layers=len(blocks))
    engine = SequentialModel(info, resident=True)
    with pytest.raises(FFNQuantError, match=r"calls decoder layers 0, 1 more than once \(4 calls for 2 "
                                            r"layers: a looped depth\); the engine runs each decoder layer once"):
        engine.embed([torch.randint(3, 90, (1, 12))], _Store(None, "text"))


def test_a_forward_that_changes_the_hidden_states_between_layers_hands_each_layer_what_it_computes(tiny):
    """A model's loop that computes on the hidden states between two layers (here: doubles them): the engine hands
    each layer what that loop computes from the outputs so far (`hf.replay`), not the previous layer's output."""
    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel

    engine = SequentialModel(inspect_model(tiny["llama"]), resident=True)

    def forward(input_ids=None, **kwargs):
        h = engine.embedding(input_ids)
        rotary = engine.base.rotary_emb(h, torch.arange(input_ids.shape[1])[None])
        for i, layer in enumerate(engine.layers):
            out = layer(h * 2 if i else h, position_embeddings=rotary)
            h = out[0] if isinstance(out, tuple) else out
        return h

    object.__setattr__(engine.base, "forward", forward)
    store = _Store(None, "text")
    calls = engine.embed([torch.randint(3, 90, (1, 12))], store)
    assert engine.replay
    with engine.layer(0):
        engine.run(0, store, calls)
    item = store.get(0)
    assert torch.equal(item["hidden"], 2 * item["outs"][0])


@pytest.mark.parametrize("model_type, batch_dim", [("llama", 0), ("xlnet", 1), ("gemma3n_text", 1), ("cpmant", 0)])
def test_the_dimension_of_a_batchs_sequences_is_found_from_the_layers_hidden_states(tmp_path, model_type, batch_dim):
    """The engine takes a batch's leading sequences along the dimension that holds them: the first mostly, the
    second for XLNet's [tokens, batch, width] and Gemma 3n's AltUp [inputs, batch, tokens, width]; CPM-Ant's layers
    see more positions than tokens (its prompt's). The head is given the token ids' shape, whatever the layers'."""
    from hf_models import tiny_or_skip

    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store
    from ffnquant.hf.stream import SequentialModel

    info = inspect_model(tiny_or_skip(model_type, tmp_path / model_type))
    m = SequentialModel(info, resident=True)
    ids = torch.randint(3, 90, (3, 10), generator=torch.Generator().manual_seed(0))
    store = Store(None, "s")
    m.embed([ids], store)
    hidden = store.get(0)
    assert m.batch_dim == batch_dim and hidden.shape[batch_dim] == 3
    assert m.rows(hidden, 2).shape[batch_dim] == 2 and torch.equal(m.rows(hidden, 2).select(batch_dim, 1),
                                                                   hidden.select(batch_dim, 1))
    final, logits = m.head_out(hidden)
    assert tuple(logits.shape[:2]) == (3, 10)


@pytest.mark.parametrize("model_type", ["xlm", "blt"])
def test_a_forward_that_computes_between_its_layers_is_replayed_and_gives_the_models_logits(tmp_path, model_type):
    """XLM's list of blocks is its FFNs; its forward runs attentions and norms between them. BLT's byte decoder
    reads its encoder's states after the stack the engine runs (its config names no single width: the blocks' own
    is read). The engine runs each layer once, in order, each on the input the model's own forward computes from the
    outputs so far (`hf.replay`): a batch's stream keeps its ids and every output, and its logits and final hidden
    state are transformers' own, read a layer at a time or resident. A model that computes only in its layers keeps plain hidden states."""
    import transformers as T
    from hf_models import tiny_or_skip

    from ffnquant.hf import inspect_model
    from ffnquant.hf.replay import is_trail
    from ffnquant.hf.spill import Store
    from ffnquant.hf.stream import SequentialModel

    folder = tiny_or_skip(model_type, tmp_path / model_type)
    info = inspect_model(folder)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    from ffnquant.hf.metrics import _final_hidden, _run

    whole = _run(T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval(), info, ids)
    want, want_final = whole.logits.detach(), _final_hidden(info, whole).detach()
    for resident in (True, False):
        m = SequentialModel(info, resident=resident)
        store = Store(None, "s")
        calls = m.embed([ids], store)
        m.offload(m.embedding)  # kept: every replay embeds the ids again
        for j in range(len(m.layers)):
            with m.layer(j):
                m.run(j, store, calls)
        item = store.get(0)
        assert m.replay and is_trail(item) and len(item["outs"]) == len(m.layers) and torch.equal(item["ids"], ids)
        final, logits = m.head_out(item)
        assert torch.allclose(logits, want, rtol=0, atol=1e-5 * float(want.abs().max())), resident
        # the final hidden state the figures compare is the base model's output, as a whole forward's (BLT's local
        # decoder's, not the local encoder's that runs the layers)
        assert final.shape == want_final.shape and torch.allclose(final, want_final, rtol=0,
                                                                  atol=1e-5 * float(want_final.abs().max())), resident
        assert m.rows(item, 1)["hidden"].shape[0] == 1 and m.rows(item, 1)["ids"].shape[0] == 1
    plain = SequentialModel(inspect_model(tiny_or_skip("llama", tmp_path / "llama")), resident=True)
    plain.embed([ids], store := Store(None, "p"))
    assert not plain.replay and isinstance(store.get(0), torch.Tensor)


def test_the_first_batch_is_recorded_after_the_processs_first_forward(tiny):
    """A process's first forward may compute what it hands the layers differently from every later one (a rotary
    embedding's first call did, in some runs): the engine keeps the first batch as a later forward records it, so
    every run calibrates on the same inputs. Simulated: the embedding's first call answers otherwise."""
    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store as _Store
    from ffnquant.hf.stream import SequentialModel

    engine = SequentialModel(inspect_model(tiny["llama"]), resident=True)
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        steady = engine.embedding(ids).clone()
    calls = {"n": 0}

    def first_call_differs(module, args, out):  # returns the output to use instead
        calls["n"] += 1
        return out + 1.0 if calls["n"] == 1 else out

    handle = engine.embedding.register_forward_hook(first_call_differs)
    try:
        store = _Store(None, "text")
        engine.embed([ids], store)
    finally:
        handle.remove()
    assert calls["n"] > 1 and torch.equal(store.get(0), steady)  # a Llama's first layer takes the embeddings


def test_a_layers_second_output_the_loop_hands_to_the_next_layer_is_carried(tmp_path):
    """Zaya's decoder layers return (hidden states, router states) and its loop hands the router states to the next
    layer's router: the engine finds where (`forward.find_carried`), carries them per batch in each stream, and its
    last layer's output is transformers' own bit for bit, resident or read a layer at a time (without them the next
    layer routes on its own states alone: another model). Its base model's own parameters (an input scale and
    bias) are read with the modules beside the layers."""
    import transformers as T
    from hf_models import tiny_or_skip

    from ffnquant.hf import inspect_model
    from ffnquant.hf.spill import Store
    from ffnquant.hf.stream import SequentialModel

    folder = tiny_or_skip("zaya", tmp_path / "zaya")
    info = inspect_model(folder)
    ids = torch.randint(3, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    got = {}
    model.model.layers[-1].register_forward_hook(lambda mod, a, out: got.__setitem__("last", out[0]))
    with torch.no_grad():
        model(ids)
    for resident in (True, False):
        m = SequentialModel(info, resident=resident)
        store = Store(None, "s")
        calls = m.embed([ids], store)
        assert m.carried == {1: ("arg", 0)}, resident
        for j in range(len(m.layers)):
            with m.layer(j):
                m.run(j, store, calls)
        assert torch.equal(store.get(0), got["last"]), resident
    assert set(store.copy("again").carried) == {0}  # a copied stream hands on what the original holds
    m.carried = {}  # the router states left as the recorded call has them (none): the next layer routes otherwise
    again = Store(None, "plain")
    calls = m.embed([ids], again)
    for j in range(len(m.layers)):
        with m.layer(j):
            m.run(j, again, calls)
    assert not torch.equal(again.get(0), got["last"])


@pytest.mark.parametrize("model_type", ["mixtral", "gpt_oss", "dbrx", "llama4_text", "jetmoe"])
def test_routed_experts_made_from_each_experts_ffn_are_the_modules_own(tmp_path, model_type):
    """A layer's experts module read a layer at a time where transformers fuses the tensors as it loads: each
    expert's FFN as the checkpoint reader reads it, written through the module's own layout (gate and up side by
    side or interleaved, input-major, flat, biased: `routed.expert_weight`, `expert_bias`), is the module
    transformers loads, tensor for tensor."""
    import copy

    from hf_models import tiny_or_skip

    from ffnquant.hf import inspect_model
    from ffnquant.hf.capture import _module_for, load_hf_model
    from ffnquant.hf.stream_experts import fill_experts

    info = inspect_model(tiny_or_skip(model_type, tmp_path / model_type))
    model = load_hf_model(info)
    names = [n for n, _ in model.named_modules()]
    layer = next(layer for layer in info.layers if layer.expert is not None)
    experts = _module_for(model, info, layer, names)[1]
    made = copy.deepcopy(experts)
    with torch.no_grad():
        for p in made.parameters():
            p.zero_()
    fill_experts(made, info, layer.index)
    from ffnquant.hf.routed import expert_tensors

    # the experts' own tensors and their biases (a MoE routing its tokens itself, JetMoE's, also holds its router
    # and output bias: read by name)
    own = {n for t in expert_tensors(experts, info.arch).values() for n in (t, f"{t}_bias")}
    want = {n: p for n, p in experts.named_parameters() if n in own}
    got = dict(made.named_parameters())
    assert len(want) >= 2 and all(torch.equal(got[n], want[n]) for n in want), model_type
