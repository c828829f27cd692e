"""ffnquant.hf.discover: the decoder's own stack, the FFN inside a module that does more than the FFN, and the
checkpoint names read by the shortest tail of the stack's path that is the model's alone."""

from __future__ import annotations

import pytest

from ffnquant.hf import inspect_model
from ffnquant.hf.arch import Install
from ffnquant.hf.discover import Discovery, discover_config

T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")


def _folder(tmp_path, model_type):
    from hf_models import tiny_or_skip

    return tiny_or_skip(model_type, tmp_path / model_type)


@pytest.mark.parametrize("model_type, stack", [
    ("phi4_multimodal", "model.layers"),  # not the 24-layer audio encoder its decoder embeds, heavier at tiny sizes
    ("git", "git.encoder.layer"),  # not the image encoder's layers
], ids=["phi4-audio-tower", "git-image-tower"])
def test_the_blocks_are_the_decoders_own_stack_not_a_tower_it_embeds(tmp_path, model_type, stack):
    info = inspect_model(_folder(tmp_path, model_type))
    assert info.layers and all(layer.name.startswith(f"{stack}.") for layer in info.layers)


def test_an_mlp_that_adds_the_residual_and_normalises_is_its_linears_replaced_one_by_one(tmp_path):
    """XLNet's feed-forward returns LayerNorm(x + down(gelu(up(x)))): its output is no FFN's, yet its Linears and
    activation are one, replaced Linear by Linear; the module run so is its own output bit for bit."""
    import json

    folder = _folder(tmp_path, "xlnet")
    found = discover_config(json.loads((folder / "config.json").read_text()), "xlnet")
    assert found.ffn.install is Install.SPLIT and found.ffn.path == "ff"
    assert found.arch().split_attrs == ("layer_1", "activation_function", "layer_2")
    assert str(found.ffn.activation) == "gelu"


def test_a_module_whose_output_the_linears_do_not_make_alone_is_not_split(tmp_path):
    """BitNet normalises between its matrices: replacing the first Linear by the whole chain would skip that norm,
    so it is not split Linear by Linear (a gated FFN never is): its module stays whole and computes the norm."""
    from ffnquant.spec import Activation

    info = inspect_model(_folder(tmp_path, "bitnet"))
    assert info.arch.install is Install.MODULE and info.spec.activation is Activation.OWN_GATE


def _discovery(layers_path, names):
    import dataclasses

    from ffnquant.hf.ffn_candidates import FoundFFN

    ffn = FoundFFN("mlp", Install.MODULE, {"up_proj": "w_up", "down_proj": "w_down"}, 4, 8, False)
    d = Discovery("x", "X", layers_path, 2, ffn, (0, 1))
    return dataclasses.replace(d, shapes={n: (1,) for n in names})


@pytest.mark.parametrize("layers_path, names, want", [
    ("model.layers", ["model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight"], "layers"),
    ("model.H_module.layers", ["model.H_module.layers.0.mlp.up_proj.weight", "model.L_module.layers.0.mlp.up_proj.weight"],
     "H_module.layers"),
    # experts' lists inside the blocks are other paths, not another 'layers'
    ("model.layers", ["model.layers.0.mlp.experts.3.up_proj.weight"], "layers"),
    ("model.layers", [], "layers"),
], ids=["one-stack", "two-stacks", "experts-inside", "no-shapes"])
def test_checkpoint_names_are_read_by_the_shortest_tail_no_other_list_has(layers_path, names, want):
    assert _discovery(layers_path, names).list_suffix() == want


def test_an_ffn_whose_linears_sit_in_wrappers_behind_a_norm_is_found(tmp_path):
    """Reformer's feed_forward normalises, then runs dense.dense, dense.act_fn and output.dense (each Linear in a
    wrapper module): found one level down, and replaced Linear by Linear after the model's own norm."""
    import json

    folder = _folder(tmp_path, "reformer")
    found = discover_config(json.loads((folder / "config.json").read_text()), "reformer")
    assert found.ffn.install is Install.SPLIT and found.ffn.path == "feed_forward"
    assert found.arch().split_attrs == ("dense.dense", "dense.act_fn", "output.dense")


def test_a_gating_mlp_that_reads_batch_and_tokens_is_probed_on_a_sequence(tmp_path):
    """Moshi's MLP views fc1's output per batch and token into its gate and value halves: it fails on [tokens,
    width] and is probed on one sequence [1, tokens, width], found as a fused gate+up (SiLU)."""
    import json

    folder = _folder(tmp_path, "moshi")
    found = discover_config(json.loads((folder / "config.json").read_text()), "moshi")
    assert found.ffn.install is Install.MODULE and dict(found.ffn.roles) == {"fc1": "w_gate+w_up", "fc2": "w_down"}
    assert str(found.ffn.activation) == "silu"


def test_an_ffn_several_blocks_share_is_one_ffn_each_later_call_reading_the_first_ones_tensors(tmp_path):
    """Zamba's hybrid layers each run one shared transformer whose weights are one set of Parameters, stored once
    (under layer 0): every block's FFN is found, a later call marked as calling layer 0's and read under its
    names, and its parameters counted once. Its Mamba mixers' per-head 3-D projections ([heads, dt + 2 states,
    d], [heads, d, dt]) are not called routed experts."""
    info = inspect_model(_folder(tmp_path, "zamba"))
    assert [(layer.index, layer.shares) for layer in info.layers] == [(0, None), (1, 0)]
    assert info.layers[1].tensors == info.layers[0].tensors
    assert info.shared_groups() == ((0, 1),)
    assert info.to_dict()["ffn_params_total"] == info.spec.n_params
    assert not any("routed experts" in part for part in info.arch.float_parts), info.arch.float_parts


@pytest.mark.parametrize("model_type, calls", [("llama", ()), ("dory", (0, 1, 0, 1)), ("hrm_text", (0, 1) * 6)],
                         ids=["one-pass", "dory-recurrent", "hrm-cycles"])
def test_the_order_a_forward_calls_its_blocks_in_is_found_from_its_skeleton(tmp_path, model_type, calls):
    """The order of calls is the model's own forward's, run on its skeleton with stand-in blocks (no weight read):
    () for a model calling each block once in order; a looped depth's calls each one layer, a later call of a
    block calling its first call's FFN again, its parameters counted once. HRM's second stack of blocks (the
    same class) is said to stay float, not skipped silently."""
    import json

    folder = _folder(tmp_path, model_type)
    found = discover_config(json.loads((folder / "config.json").read_text()), model_type)
    assert found.calls == calls
    info = inspect_model(folder)
    assert info.n_layers == (len(calls) or found.n_blocks)
    assert info.to_dict()["ffn_params_total"] == info.spec.n_params * found.n_blocks
    others = [part for part in info.arch.float_parts if "stay float, ffnquant quantizes the FFNs of one list" in part]
    assert others == (["model.H_module.layers (2 blocks of HrmTextDecoderLayer): stay float, ffnquant quantizes "
                       "the FFNs of one list of blocks (model.L_module.layers)"] if model_type == "hrm_text" else [])


def test_an_mlp_taking_the_calling_layers_index_is_probed_with_it_and_found_with_what_it_adds(tmp_path):
    """Zamba 2's shared MLP takes `layer_idx` and adds that call's low-rank adapter of its input to its gate and up:
    probed with the block's index, as the model calls it, it is the module's own middle reading the FFN's input
    (`hf.own.OwnMiddle`), passed the index; each layer's copy gets its own (`test_hf_adapters`)."""
    info = inspect_model(_folder(tmp_path, "zamba2"))
    template = info.arch.activation_template
    assert template.reads_input and template.layer_idx == 0 and info.calls_differ()


def test_a_probe_fills_its_buffers_so_its_verdict_is_the_same_every_run():
    """A module built on the meta device has its buffers (xIELU's beta and eps) as meta too: materialised with
    to_empty they held whatever memory did, and a probe's verdict could change from run to run. Filled from the
    seeded generator, two probes of one module are equal, buffers included."""
    import torch
    from torch import nn

    from ffnquant.hf.ffn_candidates import FoundFFN
    from ffnquant.hf.probe import _shrunk_copy

    class WithBuffer(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(4, 8), nn.Linear(8, 4)
            self.register_buffer("beta", torch.tensor(0.5))
            self.register_buffer("steps", torch.tensor([3]))

        def forward(self, x):
            return self.down(torch.relu(self.up(x)) * self.beta)

    with torch.device("meta"):
        module = WithBuffer()
    ffn = FoundFFN("", Install.MODULE, {"up": "w_up", "down": "w_down"}, 4, 8, False)
    first, second = (_shrunk_copy(module, ffn, 4, 8, torch.Generator().manual_seed(0)) for _ in range(2))
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    # the buffers are the generator's next draws after the parameters' (not left-over memory that may repeat)
    gen = torch.Generator().manual_seed(0)
    for p in first.parameters():
        torch.randn(p.shape, generator=gen)
    assert torch.equal(first.beta, torch.randn((), generator=gen) * 0.5)
    assert int(first.steps) == 0


def _apertus_with_learned_activations(tmp_path):
    """A tiny Apertus whose xIELU parameters differ per layer (as trained ones do), saved as transformers saves it."""
    import torch

    folder = _folder(tmp_path, "apertus")
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.mlp.act_fn.alpha_p.fill_(0.3 + 0.4 * i)
            layer.mlp.act_fn.alpha_n.fill_(-0.5 + 0.7 * i)
            layer.mlp.act_fn.beta.fill_(0.25 + 0.5 * i)
    model.save_pretrained(folder, safe_serialization=True)
    return folder, model


def test_an_activation_with_learned_parameters_is_the_models_own_module_read_per_layer(tmp_path):
    """Apertus' xIELU has learned parameters per layer: no named activation reproduces the MLP, its own module does.
    Each layer's FFN computes with that layer's parameters from the checkpoint: its output is the model's MLP's."""
    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.spec import Activation

    folder, model = _apertus_with_learned_activations(tmp_path)
    info = inspect_model(folder)
    assert info.spec.activation is Activation.OWN and info.hf_activation == "own (XIELUActivation)"
    assert info.arch.activation_attr == "act_fn"
    layers = load_ffn_layers(info, "all")
    assert len(layers) == len(model.model.layers) == 2
    x = torch.randn(9, info.spec.d_model, generator=torch.Generator().manual_seed(1)) * 3
    for layer in layers:
        mlp = model.model.layers[layer.info.block].mlp
        assert torch.equal(layer.ffn.activation.alpha_p.detach(), mlp.act_fn.alpha_p.detach())  # this layer's, not the init's
        with torch.no_grad():
            ours, theirs = layer.ffn(x), mlp(x)
        # the same operations on the same float32 values: summation order at most
        assert torch.allclose(ours, theirs, rtol=0, atol=64 * torch.finfo(torch.float32).eps * float(theirs.abs().max()))
    with torch.no_grad():  # and the two layers do differ: the parameters are really read per layer
        assert not torch.equal(layers[0].ffn.activation(x), layers[1].ffn.activation(x))


def test_an_own_activations_missing_tensor_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    from ffnquant.errors import FFNQuantError

    folder, _ = _apertus_with_learned_activations(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.act_fn.alpha_n"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(FFNQuantError, match=r"tensor 'model\.layers\.1\.mlp\.act_fn\.alpha_n' is missing: the "
                                            r"model's own activation \(XIELUActivation"):
        inspect_model(folder)


def test_an_ffn_with_its_models_own_activation_exports_to_onnx_as_it_computes(tmp_path):
    """The per-layer ONNX graph of an FFN computing its model's own activation carries that layer's parameters."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.onnx.export import onnx_proto

    folder, _ = _apertus_with_learned_activations(tmp_path)
    x = np.random.default_rng(0).normal(size=(1, 5, 32)).astype(np.float32)
    for layer in load_ffn_layers(inspect_model(folder), "all"):
        proto, _ = onnx_proto(layer.ffn)
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        got = session.run(None, {session.get_inputs()[0].name: x})[0]
        with torch.no_grad():
            want = layer.ffn(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("module, expected", [
    ("silu", True), ("per-channel-scale", True), ("softmax", False), ("two-inputs", False)])
def test_only_an_elementwise_module_is_taken_as_the_models_own_activation(module, expected):
    import torch
    from torch import nn

    from ffnquant.hf.own import elementwise, rowwise

    class PerChannel(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 16))

        def forward(self, x):
            return torch.tanh(x) * self.scale

    class TwoInputs(nn.Module):
        def forward(self, gate, up):
            return gate * up

    made = {"silu": nn.SiLU(), "per-channel-scale": PerChannel(), "softmax": nn.Softmax(dim=-1),
            "two-inputs": TwoInputs()}[module]
    assert elementwise(made, 16, torch.Generator().manual_seed(0)) is expected
    # per token: a softmax over each token's values mixes that token's alone
    assert rowwise(made, 16, torch.Generator().manual_seed(0)) is (expected or module == "softmax")


def test_an_activation_no_named_one_reproduces_is_the_models_own_even_without_parameters(tmp_path):
    """A Llama with transformers' quick_gelu (x * sigmoid(1.702 x)): no activation ffnquant names computes it, the
    model's own parameterless module does, and the FFN computes with it what the model's MLP computes."""
    import json

    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.spec import Activation
    from hf_models import write_llama_like

    folder = tmp_path / "m"
    write_llama_like(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(cfg, hidden_act="quick_gelu")))
    info = inspect_model(folder)
    assert info.spec.activation is Activation.OWN and info.hf_activation == "own (QuickGELUActivation)"
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    x = torch.randn(5, info.spec.d_model, generator=torch.Generator().manual_seed(2))
    for layer in load_ffn_layers(info, "all"):
        with torch.no_grad():
            theirs = model.model.layers[layer.info.block].mlp(x)
            assert torch.allclose(layer.ffn(x), theirs, rtol=0,
                                  atol=64 * torch.finfo(torch.float32).eps * float(theirs.abs().max()))


@pytest.mark.parametrize("model_type, owner", [
    ("minimax_m3_vl_text", "MiniMaxM3VLExperts"),  # clamped SwiGLU: (clamp(up) + 1) * glu(clamp(gate))
    ("inkling2_text", "Inkling2Experts"),  # soft-capped gate and up beside sigmoid(gate)
], ids=["minimax-m3-clamped", "inkling2-softcapped"])
def test_an_experts_own_gate_function_of_gate_and_up_is_computed_as_the_model_does(tmp_path, model_type, owner):
    """Experts whose gate is a function of gate and up together (no act(gate) * up reproduces them): the experts
    module's own gate function (`Activation.OWN_GATE`); each expert's FFN is the module's output for tokens routed
    to that expert alone."""
    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.spec import Activation

    folder = _folder(tmp_path, model_type)
    info = inspect_model(folder)
    assert info.spec.activation is Activation.OWN_GATE and info.hf_activation == f"own_gate ({owner})"
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    x = torch.randn(6, info.spec.d_model, generator=torch.Generator().manual_seed(3)) * 4  # past the caps and clamps
    for layer in load_ffn_layers(info, [info.layers[-1].index]):
        experts = model.get_submodule(layer.info.name)
        with torch.no_grad():
            theirs = experts(x, torch.full((6, 1), layer.expert), torch.ones(6, 1))
            ours = layer.ffn(x)
        assert torch.allclose(ours, theirs, rtol=0, atol=64 * torch.finfo(torch.float32).eps * float(theirs.abs().max()))


@pytest.mark.parametrize("model_type, owner, state", [
    ("bitnet", "BitNetMLP", "ffn_sub_norm.weight"),  # RMSNorm of act(gate) * up, before down_proj
    ("dory", "DoryMLP", "suv_gate"),  # learned gate and up scales, an L2 norm of the hidden
], ids=["bitnet-sub-norm", "dory-scales-and-l2-norm"])
def test_an_mlp_computing_more_between_its_linears_is_computed_by_its_own_module(tmp_path, model_type, owner, state):
    """What a dense MLP computes between its Linears beyond act(gate) * up (a norm of the hidden, learned scales)
    is the MLP's own module run with its Linears replaced by slices of gate and up (`hf.own.OwnMiddle`): each
    layer's parameters read from its checkpoint, the FFN's output the model's MLP's."""
    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.spec import Activation

    folder = _folder(tmp_path, model_type)
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():  # per-layer values, as trained ones have: read per layer, not the init's
        for i, layer in enumerate(model.model.layers):
            layer.mlp.get_parameter(state).copy_(torch.linspace(0.5, 1.5 + i, layer.mlp.get_parameter(state).numel()))
    model.save_pretrained(folder, safe_serialization=True)
    info = inspect_model(folder)
    assert info.spec.activation is Activation.OWN_GATE and info.hf_activation == f"own_gate ({owner})"
    x = torch.randn(2, 5, info.spec.d_model, generator=torch.Generator().manual_seed(4))
    for layer in load_ffn_layers(info, "all"):
        mlp = model.model.layers[layer.info.block].mlp
        assert torch.equal(layer.ffn.activation.stored.get_parameter(state), mlp.get_parameter(state))
        with torch.no_grad():
            ours, theirs = layer.ffn(x), mlp(x)
        assert torch.allclose(ours, theirs, rtol=0, atol=64 * torch.finfo(torch.float32).eps * float(theirs.abs().max()))


def test_routed_experts_ffnquant_cannot_run_are_named_float_never_skipped():
    """Routed experts whose module ffnquant cannot run as a model's MoE block does (here: a forward taking a
    routing object of its own) beside a dense MLP: the MLP is quantized, the experts are said to stay float, with
    the probe's reason, not skipped."""
    import types

    import torch
    from torch import nn

    from ffnquant.hf.discover import discover

    d, f, n_experts = 8, 16, 4

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.randn(n_experts, 2 * f, d))
            self.down_proj = nn.Parameter(torch.randn(n_experts, d, f))

        def forward(self, hidden_states, routing):  # a protocol of its own
            return routing.combine(hidden_states)

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, f), nn.Linear(d, f), nn.Linear(f, d)

        def forward(self, x):
            return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp, self.experts = MLP(), Experts()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.config = types.SimpleNamespace(hidden_size=d, model_type="toy")
            self.layers = nn.ModuleList([Block(), Block()])

    found = discover(Model(), "toy")
    assert found.ffn.path == "mlp"
    parts = [p for p in found.float_parts if " experts (routed experts: " in p]
    assert len(parts) == 2 and all("ffnquant cannot reproduce this FFN's output" in p and "running a copy of it "
                                   "failed" in p and p.endswith("stay float, ffnquant quantizes mlp here")
                                   for p in parts), parts


def test_input_major_biased_interleaved_experts_are_read_and_computed_as_the_model_does(tmp_path):
    """gpt-oss keeps its experts input-major (gate_up_proj [E, d, 2f], down_proj [E, f, d]) with biases, gate and up
    columns alternating, and a clamped gate function of both (`_apply_gate`): each expert's FFN is read with its
    biases, gate and up de-interleaved, and computes the module's output for the tokens routed to it, bit for bit."""
    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.spec import Activation

    folder = _folder(tmp_path, "gpt_oss")
    info = inspect_model(folder)
    arch = info.arch
    assert arch.install is Install.EXPERTS and arch.transposed and arch.interleaved and info.spec.bias
    assert info.spec.activation is Activation.OWN_GATE and info.hf_activation == "own_gate (GptOssExperts)"
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    x = torch.randn(6, info.spec.d_model, generator=torch.Generator().manual_seed(5)) * 4
    for layer in load_ffn_layers(info, [info.layers[-1].index]):
        experts = model.get_submodule(layer.info.name)
        # gate and up: every other column of the stored [d, 2f], as the model's own gate function reads them
        assert torch.equal(layer.ffn.w_gate.weight, experts.gate_up_proj[layer.expert][:, 0::2].t())
        assert torch.equal(layer.ffn.w_up.bias, experts.gate_up_proj_bias[layer.expert][1::2])
        with torch.no_grad():
            theirs = experts(x, torch.full((6, 1), layer.expert), torch.ones(6, 1))
            assert torch.equal(layer.ffn(x), theirs)


def test_square_experts_whose_width_is_the_models_are_read_and_computed_as_the_model_does(tmp_path):
    """Experts as wide as the model (moe_intermediate_size == hidden_size: down_proj [E, d, d] reads the same
    output- or input-major): found, the reading the module computes kept, each expert's FFN its output bit for bit."""
    import torch

    from hf_models import D, save_causal_tiny, tokenizer
    from ffnquant.hf import load_ffn_layers

    T.logging.set_verbosity_error()
    folder = save_causal_tiny(T, "qwen3_moe", tmp_path / "square", tokenizer(T), moe_intermediate_size=D)
    info = inspect_model(folder)
    assert info.arch.install is Install.EXPERTS and info.spec.d_ff == info.spec.d_model == D
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(5))
    for layer in load_ffn_layers(info, [info.layers[-1].index]):
        experts = model.get_submodule(layer.info.name.rpartition(".")[0])  # named per expert, as on disk
        assert torch.equal(layer.ffn.w_down.weight, experts.down_proj[layer.expert])  # output-major, not transposed
        with torch.no_grad():
            theirs = experts(x, torch.full((6, 1), layer.expert), torch.ones(6, 1))
            assert torch.equal(layer.ffn(x), theirs)


def test_input_major_biased_experts_replaced_in_the_model_compute_the_model(tmp_path):
    """gpt-oss' experts replaced by ffnquant's FFNs (here the float ones; the experts not replaced computed
    input-major with their biases) leave the model's logits as they were, and the inputs captured per expert are
    the tokens routed to it."""
    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.hf.capture import ffn_input_hooks, install_ffns

    folder = _folder(tmp_path, "gpt_oss")
    info = inspect_model(folder)
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(6))
    layers = load_ffn_layers(info, "all")
    seen: dict[str, int] = {}
    with torch.no_grad():
        want = model(ids).logits
        with install_ffns(model, info, {layer.info: layer.ffn for layer in layers}):
            got = model(ids).logits
        with ffn_input_hooks(model, info, [layer.info for layer in layers],
                             lambda layer, x: seen.__setitem__(layer.label, seen.get(layer.label, 0) + x.shape[0])):
            model(ids)
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    k = model.config.num_experts_per_tok
    assert sum(n for label, n in seen.items() if label.startswith("L0.")) == 10 * k  # every token to k experts


@pytest.mark.parametrize("layout, expected", [("interleaved", True), ("side-by-side", False), ("mixing", None)])
def test_an_experts_gate_function_tells_how_it_reads_gate_and_up(layout, expected):
    import torch
    from torch import nn

    from ffnquant.hf.own import gate_interleaved

    class Experts(nn.Module):
        def _apply_gate(self, gate_up):
            if layout == "interleaved":
                return torch.sigmoid(gate_up[..., ::2]) * gate_up[..., 1::2]
            if layout == "side-by-side":
                gate, up = gate_up.chunk(2, dim=-1)
                return torch.sigmoid(gate) * up
            return gate_up.sum(dim=-1, keepdim=True).expand(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    assert gate_interleaved(Experts(), 8, torch.Generator().manual_seed(0)) is expected


def test_a_routed_call_is_read_whether_its_arguments_come_by_position_or_by_name():
    """A MoE block may call its experts module with the routing by keyword, under the module's own names; a module
    that takes every expert's rows stacked (Llama 4's) hands each row to its one expert, weight 1."""
    import torch
    from torch import nn

    from ffnquant.hf.routed import routed_rows

    class Experts(nn.Module):
        def forward(self, hidden_states, router_indices=None, routing_weights=None):
            return hidden_states

    h, i, w = torch.zeros(2, 4), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1)
    for args, kwargs in (((h, i, w), {}), ((h,), {"routing_weights": w, "router_indices": i})):
        got = routed_rows(Experts(), args, kwargs)
        assert torch.equal(got[0], h) and got[1] is i and got[2] is w

    class Stacked(nn.Module):
        num_experts = 3

        def forward(self, hidden_states):
            return hidden_states

    rows = torch.randn(6, 4)
    x, index, weights = routed_rows(Stacked(), (rows,), {})
    assert torch.equal(x, rows) and index.flatten().tolist() == [0, 0, 1, 1, 2, 2] and torch.equal(weights, torch.ones(6, 1))


def test_flat_experts_with_separate_gate_and_up_are_read_and_computed_as_the_model_does(tmp_path):
    """DBRX holds its experts flat in a child module (experts.mlp.w1, v1, w2: [E x f, d] each; w1 and v1 rows are
    gate and up outputs, w2's rows are down's inputs): which tensor is down and which is the gate is settled by the
    probe; each expert's FFN is read as views of those tensors and computes the module's output bit for bit."""
    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.hf.routed import expert_weight

    folder = _folder(tmp_path, "dbrx")
    info = inspect_model(folder)
    arch = info.arch
    assert arch.install is Install.EXPERTS and arch.flat_experts and not arch.transposed
    assert arch.input_major == ("mlp.w2",) and {arch.roles["mlp.w1"], arch.roles["mlp.v1"]} == {"w_gate", "w_up"}
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    x = torch.randn(6, info.spec.d_model, generator=torch.Generator().manual_seed(5)) * 4
    f = info.spec.d_ff
    for layer in load_ffn_layers(info, [info.layers[-1].index]):
        experts = model.get_submodule(layer.info.name)
        rows = slice(layer.expert * f, (layer.expert + 1) * f)
        assert torch.equal(layer.ffn.w_gate.weight, experts.mlp.w1[rows])
        assert torch.equal(layer.ffn.w_down.weight, experts.mlp.w2[rows].t())
        view = expert_weight(experts, layer.expert, "w_down", arch)
        assert view.data_ptr() == experts.mlp.w2[rows].data_ptr()  # a view: quantized weights written in place
        with torch.no_grad():
            theirs = experts(x, torch.full((6, 1), layer.expert), torch.ones(6, 1)).reshape(x.shape)
            assert torch.equal(layer.ffn(x), theirs)


@pytest.mark.parametrize("shapes, d_ff, want", [
    # d == f (square experts): the [d, d] down reads the same either way, so both are candidates
    ({"gate_up_proj": (4, 16, 8), "down_proj": (4, 8, 8)}, 8, [((), "gate_up_proj"), (("down_proj",), "gate_up_proj")]),
    ({"gate_up_proj": (4, 32, 8), "down_proj": (4, 8, 16)}, 16, [((), "gate_up_proj")]),  # Mixtral's
    ({"gate_up_proj": (4, 8, 32), "down_proj": (4, 16, 8)}, 16, [(("gate_up_proj", "down_proj"), "gate_up_proj")]),
    ({"w1": (4, 16, 8), "v1": (4, 16, 8), "w2": (4, 16, 8)}, 16,  # DBRX's: any of the three may be down, input-major
     [(("w2",), "w1"), (("v1",), "w1"), (("w1",), "v1")]),
], ids=["square", "output-major", "input-major", "three-alike"])
def test_every_reading_of_expert_tensors_as_an_ffn_is_a_candidate(shapes, d_ff, want):
    """Expert tensors are read by shape alone into every FFN they can be (the probe keeps the one the module
    computes): which one is down, and which are stored input-major."""
    from torch import nn

    from ffnquant.hf.ffn_candidates import _expert_tensors

    found = _expert_tensors("experts", nn.Module(), shapes, 8, False)
    got = sorted((f.input_major, next(n for n, r in f.roles.items() if r != "w_down")) for f in found)
    assert got == sorted(want)
    assert all(f.d_ff == d_ff and f.experts == 4 for f in found)


def test_experts_whose_matrices_are_modules_of_a_self_routing_moe_are_read_captured_and_replaced(tmp_path):
    """JetMoE's MoE routes its tokens itself and holds its experts' matrices in two child modules, each called with
    the rows sorted by expert and every expert's count: each expert's FFN is read from their 3-D tensors and computes
    what they compute; replaced by ffnquant's FFNs (here the float ones) the model's logits stay as they were, a
    changed FFN changes them, and each expert's captured inputs are the rows the router sent it."""
    import torch

    from ffnquant.hf import load_ffn_layers
    from ffnquant.hf.capture import ffn_input_hooks, install_ffns

    folder = _folder(tmp_path, "jetmoe")
    info = inspect_model(folder)
    assert info.arch.install is Install.EXPERTS and info.arch.matrix_experts
    assert info.arch.roles["input_linear.weight"] == "w_gate+w_up" and info.arch.roles["output_linear.weight"] == "w_down"
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    layers = load_ffn_layers(info, "all")
    moe = model.get_submodule(layers[0].info.name)
    rows = torch.randn(5, info.spec.d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # expert 1 alone: what the module's own matrices and activation compute
        h = moe.input_linear(rows, [0, 5, 0, 0])
        gate, up = h.chunk(2, dim=-1)
        assert torch.equal(layers[1].ffn(rows), moe.output_linear(moe.activation(gate) * up, [0, 5, 0, 0]))
    ids = torch.randint(3, 90, (1, 10), generator=torch.Generator().manual_seed(6))
    seen: dict[str, int] = {}
    doubled = {layer.info: (lambda x, f=layer.ffn: 2 * f(x)) for layer in layers}
    with torch.no_grad():
        want = model(ids).logits
        with install_ffns(model, info, {layer.info: layer.ffn for layer in layers}):
            got = model(ids).logits
        with install_ffns(model, info, doubled):
            changed = model(ids).logits
        with ffn_input_hooks(model, info, [layer.info for layer in layers],
                             lambda layer, x: seen.__setitem__(layer.label, seen.get(layer.label, 0) + x.shape[0])):
            model(ids)
        assert torch.equal(model(ids).logits, want)  # every forward put back
    assert torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max()))
    assert not torch.allclose(changed, want, rtol=0, atol=1e-3 * float(want.abs().max()))
    assert sum(n for label, n in seen.items() if label.startswith("L0.")) == 10 * model.config.num_experts_per_tok


def test_the_ffn_with_the_most_parameters_is_kept_even_split_across_children(tmp_path):
    """X-MOD's blocks hold a language adapter (an MLP module of d_ff 16) beside their main FFN (intermediate.dense
    and output.dense, in two children: d_ff 64): the main FFN is kept, the adapter stays float with its reason."""
    info = inspect_model(_folder(tmp_path, "xmod"))
    assert info.spec.d_ff == 64 and str(info.arch.install) == "split"
    assert any("adapter_modules.en_XX (d_ff 16): stays float" in part for part in info.arch.float_parts)


def test_a_model_needing_a_language_says_where_to_set_it(tmp_path, capsys):
    """Without a default language X-MOD's forward refuses a plain call: the refusal names the config key and the
    languages the model has."""
    import json

    from ffnquant.cli import main

    folder = _folder(tmp_path, "xmod")
    config = json.loads((folder / "config.json").read_text())
    config["default_language"] = None
    (folder / "config.json").write_text(json.dumps(config))
    capsys.readouterr()  # the tiny model's writing
    assert main(["quantize", "--model", str(folder), "--scheme", "w8a8", "--calib-tokens", "64", "--eval-tokens",
                 "32", "--no-onnx", "--no-progress", "--out-reports", str(tmp_path / "q")]) == 2
    err = capsys.readouterr().err.strip()
    assert 'set "default_language" in its config.json to one of its languages (en_XX)' in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "q").exists()

