"""The model's skeleton as the engine (`hf.stream`) runs it: built on the meta device (`parameters_on_meta`),
its list of decoder layers and the module that embeds the ids and runs them (`decoder_list`, `base_of`, `beside`),
the stand-ins that record what the model's forward passes each layer (`StandIn`), and the checkpoint names of its
parameters (`stored_names`)."""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any

import torch
from torch import nn

from ..errors import FFNQuantError
from .weights import loaded_names

__all__ = ["Stop", "StandIn", "base_of", "beside", "causal_lm_class", "causal_lm_from_config", "parameters_on_meta",
           "stored_names", "decoder_list", "raised_in_transformers"]


def causal_lm_class(transformers: Any, config: Any) -> Any:
    """The causal-LM class that builds a model of `config` (a config, or a model folder whose config.json is read):
    transformers' AutoModelForCausalLM where it maps the config's type, else the class config.json's
    `architectures` names (Mllama's and Emu3's text models are saved by their own ForCausalLM class under a
    model_type the auto mapping does not list), else AutoModelForCausalLM (whose error then says why)."""
    auto = transformers.AutoModelForCausalLM
    if isinstance(config, (str, os.PathLike)):
        try:
            config = transformers.AutoConfig.from_pretrained(str(config), local_files_only=True)
        except Exception:  # noqa: BLE001 - a config transformers cannot read: the loader's own error says why
            return auto
    if type(config) in getattr(auto, "_model_mapping", {}):
        return auto
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and str(name).endswith(("ForCausalLM", "LMHeadModel")) \
                and isinstance(config, getattr(cls, "config_class", None) or ()):
            return cls
    return auto


def causal_lm_from_config(transformers: Any, config: Any, **kwargs: Any) -> nn.Module:
    """A causal LM built from `config` by `causal_lm_class` (a model class builds with `_from_config`)."""
    cls = causal_lm_class(transformers, config)
    return cls.from_config(config, **kwargs) if cls is transformers.AutoModelForCausalLM \
        else cls._from_config(config, **kwargs)


def raised_in_transformers(exc: BaseException) -> bool:
    """Whether transformers' code, not ffnquant's (an FFN installed in the layer), is the last of the two in the
    exception's traceback."""
    last = ""
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if "/transformers/" in name or "/ffnquant/" in name:
            last = name
        tb = tb.tb_next
    return "/transformers/" in last


class Stop(Exception):
    """Raised by the last stand-in: the model's forward has recorded what it builds for every layer."""


def base_of(model: nn.Module, list_name: str) -> nn.Module:
    """The module whose forward embeds the token ids and runs the decoder layers `list_name`: the list's parent
    (LlamaModel), or the first ancestor taking `input_ids` (BertModel, whose encoder takes hidden states)."""
    parts = list_name.split(".")[:-1]
    while parts:
        module = model.get_submodule(".".join(parts))
        try:
            if "input_ids" in inspect.signature(module.forward).parameters:
                return module
        except (TypeError, ValueError):
            pass
        parts.pop()
    return model


def beside(base: nn.Module, layers: nn.Module) -> list[nn.Module]:
    """The modules of `base` outside the decoder layers, as large as can be (BertModel's embeddings and pooler, and
    its encoder's parts beside the layers)."""
    out = []
    for child in base.children():
        if child is layers:
            continue
        holds = any(m is layers for m in child.modules())
        out += beside(child, layers) if holds else [child]
    return out


class StandIn(nn.Module):
    """Stands in for a decoder layer while the model's own forward runs: records the arguments it is given,
    returns `hidden` (or its input unchanged) and, with `stop`, ends the forward there."""

    def __init__(self, record: list | None, hidden: torch.Tensor | None = None, stop: bool = False,
                 as_tuple: bool = False, carry: Any = None) -> None:
        super().__init__()
        self.record, self.hidden, self.stop, self.as_tuple = record, hidden, stop, as_tuple
        self.carry = carry  # a tuple's second output (`hf.forward.find_carried` marks it)

    def __getattr__(self, name: str) -> Any:
        # what the model's forward asks of its layers beside calling them (BigBird's set_attention_type): the layer's
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = self.__dict__.get("_layer")
            if layer is None:
                raise
            return getattr(layer, name)

    by_name = False  # whether the model's loop passed the hidden states by name (Reformer's: not first either)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if "hidden_states" in kwargs:
            hidden_states, self.by_name = kwargs.pop("hidden_states"), True
        else:
            hidden_states, args = args[0], args[1:]
        if self.record is not None:
            self.record.append((hidden_states, args, kwargs))
        if self.stop:
            raise Stop
        out = self.hidden if self.hidden is not None else hidden_states
        # in the form the model's loop reads its layers' outputs: (hidden, attention weights) for Falcon's
        return answer(out, self.carry, self.as_tuple)


def answer(out: Any, carry: Any, form: Any) -> Any:
    """A layer's output in the form the model's loop reads it (`form`): the hidden states alone (False), a tuple
    (hidden states, second output) (True), or the layer's own named tuple, read by field (Reformer's reversible
    layers: ReformerOutput(hidden_states, attn_output, ...)), its later fields None."""
    if not form:
        return out
    if form is True:
        return (out, carry)
    return form(out, carry, *(None,) * (len(form._fields) - 2))


def output_form(out: Any) -> Any:
    """The form `answer` gives a layer's output `out` as the layer returns it: its named tuple type where it is one
    of two fields or more (read by field), else True."""
    fields = getattr(type(out), "_fields", None)
    return type(out) if isinstance(out, tuple) and fields and len(fields) >= 2 else True


@contextlib.contextmanager
def parameters_on_meta():
    """While active, every parameter a module registers moves to the meta device: a model's skeleton costs no
    memory, while its buffers (rotary frequencies, embedding scales) are computed as usual. Linear and
    Embedding allocate their weight with torch.empty first, which touches no page."""
    register = nn.Module.register_parameter
    moved: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # a Parameter registered twice stays one (RoBERTa's
    # lm_head.decoder.bias is its lm_head.bias)

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None:
            if id(param) not in moved or moved[id(param)][0] is not param:
                meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
                moved[id(param)] = (param, meta)
                moved[id(meta)] = (meta, meta)  # registered again under another name (the tie): itself
            module._parameters[name] = moved[id(param)][1]

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def stored_names(model: nn.Module, keys) -> dict[str, str]:
    """The model's parameter name -> the checkpoint's tensor name, where transformers renames a key as it loads
    (its checkpoint conversion mapping's renamings: GPT-NeoX's `embed_out` is the class's `lm_head`)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        return loaded_names(keys, get_model_conversion_mapping(model))
    except Exception:  # a transformers without conversion mappings loads checkpoints by their own names
        return {}


def decoder_list(model: nn.Module, module_name: str) -> tuple[str, int]:
    """(name of the ModuleList of decoder layers, index) holding the module `module_name`: the first
    `<list>.<i>` on its path whose `<list>` is a ModuleList (model.layers.3.mlp.experts.1 -> model.layers, 3)."""
    parts = module_name.split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit() and isinstance(model.get_submodule(".".join(parts[:i])), nn.ModuleList):
            return ".".join(parts[:i]), int(parts[i])
    raise FFNQuantError(f"the FFN module {module_name!r} is not inside a list of decoder layers")
