"""The engine's streams for a model whose forward computes between its decoder layers: XLM's attentions and norms
run beside its list of FFNs, the list the engine runs layer by layer. Each layer is still run once, in order, on
what the model hands it; the input of the next one is what the model's own forward computes from every output so
far, found by running that forward again with each layer already run answering its output (`advanced`), and the
model's output likewise (`head`). A batch's stream is then a trail (`trail`): its token ids, every layer's output
so far, and the hidden states the next layer takes (its last output after the last layer). `hf.stream` keeps one
per batch where it keeps hidden states for a model that computes only inside its layers.

The cost is one more partial forward per layer and batch (what the model computes between its layers, again from
the start: a model of n layers runs its in-between parts n^2 / 2 times) and every layer's output kept."""

from __future__ import annotations

from typing import Any

import torch

from .skeleton import StandIn, Stop

__all__ = ["advanced", "call_at", "current", "head", "is_trail", "rows", "trail"]


def trail(ids: torch.Tensor, hidden: torch.Tensor) -> dict[str, Any]:
    """A batch's stream before its first layer: its token ids and the hidden states the first layer takes."""
    return {"ids": ids, "outs": [], "hidden": hidden}


def is_trail(item: Any) -> bool:
    return isinstance(item, dict) and "outs" in item


def current(item: Any) -> torch.Tensor:
    """The hidden states the stream's next layer takes (its last layer's output after the last one)."""
    return item["hidden"] if is_trail(item) else item


def rows(item: Any, n: int, dim: int) -> Any:
    """A stream's first `n` sequences: the ids' rows, and every output's and the hidden states' along `dim`."""
    if not is_trail(item):
        return item.narrow(dim, 0, n)

    def cut(o: Any) -> Any:  # an output kept with its second output (`advanced`)
        return tuple(cut(x) for x in o) if isinstance(o, tuple) else None if o is None else o.narrow(dim, 0, n)

    return {"ids": item["ids"][:n], "outs": [cut(o) for o in item["outs"]], "hidden": item["hidden"].narrow(dim, 0, n)}


def _stand_ins(engine: Any, outs: list[Any], record: list | None, stop_at: int | None) -> list[StandIn]:
    """Each layer a stand-in: those already run answer their outputs (with their second outputs, where kept);
    the one at `stop_at` records what the model hands it and ends the forward."""
    n = len(engine.layers)

    def on(value: Any) -> Any:
        return None if value is None else value.to(engine.device)

    pairs = [o if isinstance(o, tuple) else (o, None) for o in outs]
    return [StandIn(record if i == stop_at else None, on(pairs[i][0]) if i < len(pairs) else None,
                    stop=i == stop_at, as_tuple=engine._tuple_out, carry=on(pairs[i][1]) if i < len(pairs) else None)
            for i in range(n)]


def advanced(engine: Any, item: dict[str, Any], out: torch.Tensor, j: int, second: Any = None) -> dict[str, Any]:
    """The stream after layer `j` gave `out` (and `second`, its second output where the model's loop hands it on):
    the output kept, and the next layer's input as the model's forward computes it from every output so far
    (after the last layer, `out` itself)."""
    outs = [*item["outs"], out if second is None else (out, second)]
    if j + 1 >= len(engine.layers):
        return {"ids": item["ids"], "outs": outs, "hidden": out}
    hidden, call = _recorded(engine, item["ids"], outs, j + 1)
    # the call as the forward hands it, its other arguments too (computed from the outputs so far: Inkling 2's
    # block states, Reformer's attn_output); `hf.stream` keeps it beside the stream (`Store.calls`)
    return {"ids": item["ids"], "outs": outs, "hidden": hidden.to(out.device), "call": call}


def call_at(engine: Any, item: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The call the model's forward hands a stream's next layer, found again from the outputs it keeps: for a stream
    cut from another (`rows`: a probe's leading sequences), whose kept call was the whole batch's."""
    return _recorded(engine, item["ids"], item["outs"], len(item["outs"]))[1]


def _recorded(engine: Any, ids: torch.Tensor, outs: list[Any], j: int) -> tuple[torch.Tensor, tuple]:
    """(hidden states, call) the model's forward hands layer `j`, every earlier layer answering its output."""
    record: list = []
    with engine._stand_ins(_stand_ins(engine, outs, record, j)), torch.no_grad():
        try:
            engine.runner(input_ids=ids.to(engine.device), use_cache=False)
        except Stop:
            pass
    return record[0][0].detach(), engine._no_cache(record[0][1], record[0][2])


def head(engine: Any, item: dict[str, Any]) -> torch.Tensor:
    """The model's logits for a stream past its last layer: its own forward on the batch's ids, every layer answering
    its output (a hook on the base model, `hf.head`'s, records its last hidden state)."""
    with engine._stand_ins(_stand_ins(engine, item["outs"], None, None)):
        return engine.model(input_ids=item["ids"].to(engine.device), use_cache=False).logits
