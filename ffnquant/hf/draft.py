"""Draft models, run from token ids through the model they draft for (Gemma 4's assistants).

A draft model's forward refuses token ids alone: each step it takes its target model's states at one position (the
target's embedding of the token there beside its last hidden state) and attends to the target's key/value states
up to that position (`shared_kv_states`), as transformers' assisted generation calls it
(`SinglePositionMultiTokenCandidateGenerator`: the query at position t, the target's keys and values [0, t]).
ffnquant calibrates and evaluates on token ids, so `feed` gives such a model a forward from token ids: the target
(`--target-model`, `infra.target_model.use_target`) runs once on the ids, and the draft model runs every position of the batch in one
call, each query seeing exactly the keys and values its own drafting step sees. The masks are built from the draft
model's own mask function, one position at a time (`_allowed`): its sliding window (one position wider than the
target's) is the model's, not a copy of it. `tests/test_hf_draft.py` checks the batched call against the drafting
calls position by position.

What is measured is the first drafting step after each position (the one whose inputs are the target's own states);
the later steps of a round feed the draft model its own last state, which a calibration on text does not reach.
"""

from __future__ import annotations

import collections
import functools
import inspect
import math
import types
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..errors import FFNQuantError, first_line
from ..infra.target_model import current_target, use_target

__all__ = ["use_target", "current_target", "target_bytes", "draft_refusal", "ids_refusal", "folder_draft_refusal", "require_target", "feed", "is_fed", "target_of"]

# the forward argument through which a draft model reads its target's keys and values (transformers' protocol:
# the target returns them with `return_shared_kv_states=True`)
_STATES = "shared_kv_states"


def target_bytes(batch_tokens: int = 0, dtype_bytes: int = 4) -> int:
    """What the target of `use_target` holds (0 without one), counted beside the draft model in every memory plan:
    its parameters loaded whole, `dtype_bytes` each (read from its safetensors headers only), and the states it keeps
    of `_TargetStates._KEEP` batches of `batch_tokens` tokens (embeddings, hidden states and key/value states of each
    attention kind, each bounded by the target's width)."""
    path = current_target()
    if path is None:
        return 0
    from .checkpoint import read_config
    from .weights import _Weights

    try:
        shapes = _Weights(Path(path), False)._shapes
        config = read_config(path)
        width = int((config.get("text_config") or config).get("hidden_size") or 0)
    except Exception:  # noqa: BLE001 - a folder the loader refuses says why when it is loaded
        return 0
    # per kept batch: embeddings and hidden states, and keys and values of two attention kinds
    states = _TargetStates._KEEP * 6 * batch_tokens * width * 4
    return dtype_bytes * sum(math.prod(shape) for shape in shapes.values()) + states


def draft_refusal(model: nn.Module) -> str | None:
    """The model's own refusal of token ids alone where it is a draft model (its forward takes its target's
    key/value states and refuses a call without them: Gemma 4's assistants say 'inputs_embeds and shared_kv_states
    cannot be None.'), else None. Runs no weight: the refusal comes before any (the model may be on the meta device)."""
    forward = getattr(type(model), "forward", None)
    try:
        if forward is None or _STATES not in inspect.signature(forward).parameters:
            return None
    except (TypeError, ValueError):
        return None
    return ids_refusal(model)


def ids_refusal(model: nn.Module) -> str | None:
    """The causal LM class's own refusal (a ValueError of transformers') of a call with token ids alone, or None
    where it takes them or fails otherwise (on its meta weights: past the ids). Its own forward, not `feed`'s."""
    from .skeleton import raised_in_transformers

    try:
        with torch.no_grad():
            type(model).forward(model, input_ids=torch.ones((1, 2), dtype=torch.long), use_cache=False)
    except ValueError as exc:
        return first_line(exc) if raised_in_transformers(exc) else None
    except Exception:  # noqa: BLE001 - it got past the ids: it takes them
        return None
    return None


@functools.lru_cache(maxsize=16)
def _folder_refusal(path: str) -> str | None:
    import transformers

    from .skeleton import causal_lm_class, causal_lm_from_config, parameters_on_meta

    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        cls = causal_lm_class(transformers, config)
        cls = getattr(cls, "_model_mapping", {}).get(type(config), cls)
        if _STATES not in inspect.signature(cls.forward).parameters:  # no skeleton built for any other model
            return None
        with parameters_on_meta():
            model = causal_lm_from_config(transformers, config)
    except Exception:  # noqa: BLE001 - a model transformers cannot build: its loader says why where it is run
        return None
    return draft_refusal(model)


def folder_draft_refusal(path: str | Path) -> str | None:
    """`draft_refusal` of the causal LM in folder `path`, from its skeleton on the meta device (no weight read)."""
    return _folder_refusal(str(path))


def require_target(path: str | Path) -> None:
    """Raises where the folder holds a draft model and no target is set (`use_target`): before the model is read."""
    if current_target() is None:
        refusal = folder_draft_refusal(path)
        if refusal is not None:
            raise FFNQuantError(_no_target(path, refusal))


def _no_target(path: Any, refusal: str) -> str:
    return (f"{path}: a draft model: its forward refuses token ids alone ({refusal}) and reads the key/value states "
            f"of the model it drafts for ({_STATES}); give that target model with --target-model PATH "
            "(target_model= in the Python API)")


def target_of(model: nn.Module) -> str | None:
    """The folder of the target a fed draft model runs through (`feed`), else None."""
    return model.forward.target.path if is_fed(model) else None


def is_fed(model: nn.Module) -> bool:
    """Whether `feed` gave the model a forward from token ids through its target."""
    return isinstance(model.__dict__.get("forward"), _FedForward)


def feed(model: nn.Module, path: Any = "the model", like: nn.Module | None = None,
         load: Callable[..., nn.Module] | None = None) -> nn.Module:
    """`model` itself; where it is a draft model (`draft_refusal`), with a forward from token ids through the
    target of `use_target`, or the target `like` (a fed model: the original of a deployed folder) is run through
    (raises naming `--target-model` where there is none). The target is loaded whole by `load` (`hf.capture`'s
    `load_hf_model`: folder, dtype=) on its first call, once per process while it stays the target."""
    if is_fed(model):
        return model
    refusal = draft_refusal(model)
    if refusal is None:
        return model
    if like is not None and is_fed(like):
        model.forward = _FedForward(model, like.forward.target)
        return model
    if not callable(getattr(type(model), "create_attention_masks", None)):
        raise FFNQuantError(f"{path}: a draft model ({refusal}) whose forward builds its attention masks otherwise "
                            "than transformers' Gemma 4 assistants (create_attention_masks): ffnquant cannot run "
                            "its drafting steps from token ids")
    target = current_target()
    if target is None:
        raise FFNQuantError(_no_target(path, refusal))
    if _LOADED.get("path") != target:  # one target held at a time
        _LOADED.clear()
        if load is None:
            raise RuntimeError("feed: a draft model's target needs a loader (`load`)")
        _LOADED.update(path=target, states=_TargetStates(target, load))
    model.forward = _FedForward(model, _LOADED["states"])
    return model


_LOADED: dict[str, Any] = {}  # the target last run through: {"path", "states"}


class _TargetStates:
    """The target model's states on a batch of token ids: its embeddings of them, its last hidden states and its
    key/value states (`shared_kv_states`); the last few batches' kept (a draft model's forward runs several times
    on each batch: recording, checks, head)."""

    # the batch being recorded (its forward runs several times in a row) and the one the head's shape-only calls use
    _KEEP = 2

    def __init__(self, path: str, load: Callable[..., nn.Module]) -> None:
        self.path, self._load, self._model, self._kept = path, load, None, collections.OrderedDict()
        self._where: tuple[torch.device, torch.dtype] | None = None

    def __deepcopy__(self, memo: dict) -> "_TargetStates":
        return self  # a copy of the draft model (the planned model's) runs through the same target: not a copy of it

    def model(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The target model, loaded whole on `device` in `dtype` (again where an earlier call wanted others)."""
        if self._model is None or self._where != (device, dtype):
            self._model = None  # freed before the next is loaded
            self._model = self._load(self.path, dtype=dtype).to(device)
            self._where = (device, dtype)
        return self._model

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
        key = (ids.shape, ids.device, dtype, ids.cpu().numpy().tobytes())
        if key in self._kept:
            self._kept.move_to_end(key)
            return self._kept[key]
        target = self.model(ids.device, dtype)
        try:
            with torch.no_grad():
                out = target(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=False)
                embeds = target.get_input_embeddings()(ids)
        except Exception as exc:  # noqa: BLE001 - the target refusing the call: said with its model's words
            raise FFNQuantError(f"--target-model {self.path!r}: its forward fails on the token ids with "
                                f"return_shared_kv_states=True ({type(exc).__name__}: {first_line(exc)}); a draft "
                                "model's target returns the key/value states it drafts from") from None
        states = getattr(out, _STATES, None)
        if not states:
            raise FFNQuantError(f"--target-model {self.path!r} ({type(target).__name__}) returns no {_STATES}: it is "
                                "not a model this draft model drafts for")
        kept = (embeds, out.hidden_states[-1], {k: (v[0], v[1]) for k, v in states.items()})
        self._kept[key] = kept
        while len(self._kept) > self._KEEP:
            self._kept.popitem(last=False)
        return kept


class _FedForward:
    """A draft model's forward from token ids: each position's drafting step, the whole batch in one call."""

    def __init__(self, model: nn.Module, target: _TargetStates) -> None:
        self.original = types.MethodType(type(model).forward, model)
        self.model, self.target = model, target
        self._allowed_of: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def __call__(self, input_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                 **kwargs: Any) -> Any:
        if kwargs.get(_STATES) is not None:  # called as the drafting loop calls it: as it is
            return self.original(input_ids=input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:
            raise FFNQuantError("a draft model runs only beside its target (assisted generation), not alone with a "
                                "KV cache of its own")
        dtype = self.model.get_input_embeddings().weight.dtype  # what the model computes in (on meta too)
        if input_ids is None:
            # only the shapes of the batch given (`hf.head`: the decoder layers answered by stand-ins): the target's
            # states of as many token ids, any
            input_ids = torch.zeros(inputs_embeds.shape[:2], dtype=torch.long, device=inputs_embeds.device)
        embeds, hidden, states = self.target(input_ids, dtype)
        n = input_ids.shape[1]
        positions = torch.arange(n, device=input_ids.device).unsqueeze(0)
        allowed = self._allowed(n, states, input_ids.device)
        for drop in ("attention_mask", "position_ids", "use_cache"):
            kwargs.pop(drop, None)
        self.model.create_attention_masks = types.MethodType(_masks(allowed, positions), self.model)
        try:
            return self.original(inputs_embeds=torch.cat([embeds, hidden], dim=-1).to(dtype), position_ids=positions,
                                 shared_kv_states={k: (v[0].to(dtype), v[1].to(dtype)) for k, v in states.items()},
                                 use_cache=False, **kwargs)
        finally:
            del self.model.create_attention_masks

    def _allowed(self, n: int, states: dict, device: torch.device) -> dict[str, torch.Tensor]:
        """[n, n] booleans per attention kind: which of the target's positions the drafting step at each position
        attends to, from the model's own masks of that step (query at t, keys and values [0, t])."""
        key = (n, str(device))
        if key in self._allowed_of:
            return self._allowed_of[key]
        width = self.model.config.get_text_config().hidden_size
        allowed = {kind: torch.zeros(n, n, dtype=torch.bool, device=device) for kind in states}
        masks = type(self.model).create_attention_masks
        for t in range(n):
            step = masks(self.model, torch.zeros(1, 1, width, device=device),
                         torch.ones(1, t + 1, dtype=torch.long, device=device),
                         {k: (v[0][:1, :, :t + 1], v[1][:1, :, :t + 1]) for k, v in states.items()})
            for kind, mask in step.items():
                if mask is None:  # every position so far
                    allowed[kind][t, :t + 1] = True
                else:  # [1, 1, 1, t + 1]: booleans, or 0 where allowed in an additive float mask
                    row = mask[0, 0, 0]
                    allowed[kind][t, :t + 1] = row if row.dtype == torch.bool else row == 0
        self._allowed_of[key] = allowed
        return allowed


def _masks(allowed: dict[str, torch.Tensor], positions: torch.Tensor):
    """A `create_attention_masks` for the batched call: per attention kind, the causal mask of the model's
    attention implementation restricted to `allowed` (transformers' `create_causal_mask`, so its format is what
    the implementation reads)."""
    from transformers.masking_utils import create_causal_mask

    def create_attention_masks(self: nn.Module, inputs_embeds: torch.Tensor, attention_mask: Any,
                               shared_kv_states: Any) -> dict[str, Any]:
        config = self.config.get_text_config()
        return {kind: create_causal_mask(config=config, inputs_embeds=inputs_embeds, attention_mask=None, cache=None,
                                         position_ids=positions, allow_is_causal_skip=False,
                                         and_mask_function=lambda b, h, q, kv, a=a: a[q, kv])
                for kind, a in allowed.items()}

    return create_attention_masks
