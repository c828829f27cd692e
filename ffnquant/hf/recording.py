"""What the model's own forward hands each decoder layer, recorded by the stand-ins (`skeleton.StandIn`): a mixin of
`hf.stream.SequentialModel`. `embed` records, per batch, the embeddings and each layer's call (the rotary
position embeddings, masks, sliding windows the class's own forward builds), and learns once how the model's loop
reads its layers' outputs (a tensor, a tuple, or the layer's own named tuple read by field), how it passes them
their hidden states (first, or by name) and what else it hands on (`hf.forward`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..errors import FFNQuantError, first_line
from . import forward, replay
from .forward import raised_in_transformers
from .skeleton import StandIn, Stop, beside, output_form
from .spill import Store
from .stream_tensors import _host

__all__ = ["Recording"]

Progress = Callable[[str, int, int], None]


class _Unpacked(Exception):
    """The model's loop unpacked a stand-in's plain tensor as (hidden, attention weights)."""


class _ReadsFields(Exception):
    """The model's loop read a stand-in's output by field name (Reformer's `layer_outputs.attn_output`): `call` is
    the first layer's, on which the layer's own output shows its form."""

    def __init__(self, call: tuple) -> None:
        super().__init__()
        self.call = call


class Recording:
    """The recording half of `hf.stream.SequentialModel` (it reads the engine's model, layers, runner and stores)."""

    def embed(self, batches: Sequence[torch.Tensor], store: Store, progress: Progress | None = None,
              stage: str = "embed") -> list[list[tuple[tuple, dict[str, Any]]]]:
        """Each batch's embeddings [batch, seq, d_model] put into `store`; returns per batch each layer's (args,
        kwargs) as the model's forward passes them (its KV cache left out: every window is a whole sequence).
        The modules outside the decoder layers are onloaded on the first call; `offload(embedding)` frees the
        largest of them once every text is embedded."""
        if self.embedding.weight.is_meta:
            # every module beside the decoder layers, and the base's own parameters (Zaya's input scale and bias)
            self.onload(self.base, skip=self.blocks)
        calls = []
        n = len(self.layers)
        for b, ids in enumerate(batches):
            try:
                try:
                    record = self._record(ids.to(self.device), n)
                except _ReadsFields as fields:  # answered from now on in the first layer's own output form
                    self._tuple_out = self._output_form(fields.call)
                    record = self._record(ids.to(self.device), n)
            except (IndexError, _Unpacked) as exc:  # the loop indexed a plain tensor's output down to a scalar
                # (MVP's 12 layers), or unpacked it as (hidden, attention weights) (Bamba's: a batch of one is one value)
                if (b or self._tuple_out) and isinstance(exc, _Unpacked):
                    raise FFNQuantError(f"{self.info.path}: its forward unpacks each decoder layer's output in a form "
                                        "the engine's stand-ins do not answer") from None
                if b or self._tuple_out:
                    raise
                self._tuple_out = True
                record = self._record(ids.to(self.device), n)
            if b == 0 and n > 1 and record[1][0].shape != record[0][0].shape:
                # the model's loop indexes each layer's output (a tuple, as Falcon's layers return): the stand-ins
                # answer in that form, and the layers' inputs are recorded again
                self._tuple_out = True
                record = self._record(ids.to(self.device), n)
            if not self._one_pass_checked:  # once per engine: the model's loop, not the text, decides it
                if not forward.base_runs_the_stack(self, ids[:1, :8].to(self.device), n):
                    self.runner = self.model
                    for module in beside(self.model, self.blocks):  # what the whole forward runs beside the layers
                        # (the head left to `hf.head`, which ties it where the checkpoint stores it once)
                        if any(p.is_meta for p in module.parameters()) \
                                and not any(m is self.head for m in module.modules()):
                            self.onload(module)
                forward.check_one_pass(self, ids.to(self.device), n)
                self.carried = forward.find_carried(self, ids.to(self.device), n)
                if not self.replay and (not forward.head_runs_from(self, ids[:1, :8].to(self.device), n)
                                        or forward.output_reads_more(self, ids[:1, :8].to(self.device), n)):
                    self.replay = True
                self._one_pass_checked = True
                # the first batch recorded again, after those forwards (and by the whole model where that runs the
                # layers): the first forward of a process computed the rotary position embeddings of its first call
                # differently in some runs (SmolLM2: 2 of 5 processes, cos off by up to 1.5e-4; every later call the
                # same in all of them), so that the first batch's layer inputs, and every figure calibrated on them,
                # moved from run to run
                record = self._record(ids.to(self.device), n)
            forward.find_batch_dim(self, ids, record[0][0], n)
            self._ids_shapes[tuple(record[0][0].shape)] = tuple(ids.shape)
            store.put(b, _host(replay.trail(ids, record[0][0]) if self.replay else record[0][0]))
            calls.append([_host(self._no_cache(args, kwargs)) for _, args, kwargs in record])
            if progress is not None:
                progress(f"{stage}: batch {b + 1}/{len(batches)}", b + 1, len(batches))
        return calls

    def _record(self, ids: torch.Tensor, n: int) -> list:
        record: list = []
        stand_ins = [StandIn(record, stop=i == n - 1, as_tuple=self._tuple_out) for i in range(n)]
        with self._stand_ins(stand_ins), torch.no_grad(), self._noting_by_name(stand_ins):
            try:
                # no KV cache: the calls are recorded without one anyway (`_no_cache`), and a cache of linear-attention
                # layers alone (a hybrid cut to a few layers) cannot size an attention mask
                self.runner(input_ids=ids, use_cache=False)
            except Stop:
                pass
            except AttributeError as exc:
                if not raised_in_transformers(exc) or "object has no attribute" not in str(exc):
                    raise
                # the model's loop reads each layer's output by field (Reformer's reversible layers: a named tuple
                # of hidden_states and attn_output): answered in the layer's own form where it is a named tuple
                if record and self._tuple_out is False:
                    raise _ReadsFields(record[0]) from None
                raise FFNQuantError(f"{self.info.path}: its forward reads each decoder layer's output as more than "
                                    f"the hidden states ({type(exc).__name__}: {first_line(exc)}); the engine runs "
                                    "a model whose layers each take and return its hidden states") from None
            except ValueError as exc:  # transformers' own refusal of the call (X-MOD: no default language set)
                if "values to unpack" in str(exc) and not self._tuple_out and record:
                    raise _Unpacked from None  # the loop unpacks each layer's output: answered as a tuple
                raise FFNQuantError(f"{self.info.path}: transformers' forward of the model refuses a plain call with "
                                    f"token ids: {first_line(exc)}{_config_hint(self.info)}") from None
        return record

    @contextlib.contextmanager
    def _noting_by_name(self, stand_ins: Sequence[StandIn]):
        """Notes, however the recording forward ends, whether the model's loop passed its layers their hidden
        states by name (`by_name`): `_layer` then calls the layers so."""
        try:
            yield
        finally:
            if any(s.by_name for s in stand_ins):
                self._hidden_by_name = True

    def _output_form(self, call: tuple) -> Any:
        """The form the stand-ins answer in (`skeleton.answer`) for a loop that reads its layers' outputs by field:
        the first layer's own output type, from the layer run on its recorded call."""
        hidden, args, kwargs = call
        with self.layer(0), torch.no_grad():
            out = self._layer(0, hidden, self._no_cache(args, kwargs))
        return output_form(out)

    def _no_cache(self, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        # The KV cache (a keyword, or positional as GPT-2 passes it) only keeps each layer's keys and values for a
        # later step: kept, it would hold those of every batch, and a second stream through a layer would attend
        # to the first one's keys as well.
        def drop(v: Any) -> Any:
            return None if isinstance(v, self.transformers.Cache) else v

        out = {k: drop(v) for k, v in kwargs.items()}
        if "use_cache" in out:
            out["use_cache"] = False
        return tuple(drop(a) for a in args), out

def _config_hint(info: Any) -> str:
    """Where the config itself sets what the model refused to run without: a default language among its
    `languages` (X-MOD's adapters, which transformers reads from config.json's `default_language`)."""
    import json

    try:
        config = json.loads((Path(info.path) / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    languages = config.get("languages")
    if isinstance(languages, list) and languages and not config.get("default_language"):
        shown = ", ".join(map(str, languages[:6])) + (", ..." if len(languages) > 6 else "")
        return (f"; set \"default_language\" in its config.json to one of its languages ({shown}): transformers "
                "reads it there, and ffnquant then runs the model with that language's adapters")
    return ""
