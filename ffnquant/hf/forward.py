"""What the engine (`hf.stream.SequentialModel`) learns once of a model's forward, from a few calls with stand-ins for
its decoder layers: whether it runs each layer once, in order (`check_one_pass`: a looped depth refused; layers with
computation between them replayed, `hf.replay`), which module runs the layers from token ids (`base_runs_the_stack`),
whether its head runs from the last hidden states alone (`head_runs_from`), which dimension of the layers' hidden
states holds a batch's sequences (`find_batch_dim`), and which argument of a layer is the previous layer's second output
(`find_carried`)."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FFNQuantError
from .skeleton import StandIn, Stop, beside, raised_in_transformers  # noqa: F401 (imported from here too)

__all__ = ["base_runs_the_stack", "check_one_pass", "find_batch_dim", "find_carried", "head_runs_from",
           "output_reads_more", "raised_in_transformers"]


class _Tally(StandIn):
    """A stand-in that logs its layer's index, the hidden states it is given and what it returns: them, moved by a
    constant of its own call (`check_one_pass`), so that a next input that is not this output shows."""

    def __init__(self, log: list, index: int, as_tuple: bool) -> None:
        super().__init__(None, as_tuple=as_tuple)
        self.log, self.index = log, index

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = hidden_states + (len(self.log) + 1) if hidden_states.is_floating_point() else hidden_states
        self.log.append((self.index, hidden_states, out, args, kwargs))
        self.hidden = out
        return super().forward(hidden_states, *args, **kwargs)


def find_carried(engine: Any, ids: torch.Tensor, n: int) -> dict[int, tuple[str, Any]]:
    """{layer j: where its call takes layer j-1's second output ("arg", position) or ("kw", name)}: a model whose loop
    hands each layer more of the previous one's output than the hidden states (Zaya's router states, which the next
    layer's router adds to its own). Found from one forward whose stand-ins return (input, a marker of their own):
    a marker handed on to the next layer as it was returned. {} where the loop reads its layers' outputs as plain
    tensors, hands nothing on, or cannot run on markers. Another layer than the next receiving one is refused: the
    engine carries an output one layer on."""
    if not engine._tuple_out:
        return {}
    markers = [torch.zeros((), device=ids.device) for _ in range(n)]  # distinct objects, told apart by identity
    record: list = []
    stand_ins = [StandIn(record, stop=i == n - 1, as_tuple=True, carry=markers[i]) for i in range(n)]
    with engine._stand_ins(stand_ins), torch.no_grad():
        try:
            engine.runner(input_ids=ids, use_cache=False)
        except Stop:
            pass
        except Exception:  # noqa: BLE001 - a loop that computes with its layers' second outputs: not judged
            return {}
    found: dict[int, tuple[str, Any]] = {}
    for j, (_, args, kwargs) in enumerate(record):
        places = [(("arg", i), a) for i, a in enumerate(args)] + [(("kw", k), v) for k, v in kwargs.items()]
        for place, value in places:
            source = next((i for i, m in enumerate(markers) if value is m), None)
            if source is None:
                continue
            if source != j - 1:
                raise FFNQuantError(f"{engine.info.path}: its forward hands decoder layer {source}'s second output to "
                                    f"layer {j}; the engine carries a layer's output to the next layer only")
            found[j] = place
    return found


def find_batch_dim(engine: Any, ids: torch.Tensor, hidden: torch.Tensor, n: int) -> None:
    """Which dimension of the decoder layers' hidden states holds the batch's sequences (`batch_dim`, where a
    batch's leading sequences are taken: `rows`): 0 mostly; XLNet's [tokens, batch, width] and Gemma 3n's AltUp
    [inputs, batch, tokens, width] hold it second, and CPM-Ant's and ProphetNet's hold more positions than
    tokens. Told by the dimension of the batch's size, or where that is ambiguous, by the one that a batch of
    one sequence makes 1. Refused where none is."""
    batch = int(ids.shape[0])
    if engine.batch_dim is not None or batch == 1:
        return
    dims = [i for i, size in enumerate(hidden.shape[:-1]) if size == batch]
    if len(dims) > 1:
        one = engine._record(ids[:1].to(engine.device), n)[0][0].shape
        dims = [i for i in dims if one[i] == 1]
    if len(dims) != 1:
        raise FFNQuantError(f"{engine.info.path}: its decoder layers take hidden states of shape "
                            f"{list(hidden.shape)} for token ids {list(ids.shape)}, no dimension of which holds "
                            "the batch's sequences; the engine runs layers on batches of sequences")
    engine.batch_dim = dims[0]


def check_one_pass(engine: Any, ids: torch.Tensor, n: int) -> None:
    """Refuse a model whose forward calls its decoder layers otherwise than the engine's layers say (each once, in
    order; a looped depth's calls in the order `hf.looped.call_order` found): the engine would measure another
    model. A forward that changes the hidden states between two layers (beyond what they compute) is run with
    each layer's input replayed from the model's own forward (`hf.replay`). Checked on one whole forward with every
    layer a stand-in that returns its input moved by a constant; a forward that cannot end so is not judged."""
    log: list[tuple[int, torch.Tensor]] = []
    with engine._stand_ins([_Tally(log, i, engine._tuple_out) for i in range(n)]), torch.no_grad():
        try:
            engine.runner(input_ids=ids, use_cache=False)
        except FFNQuantError:  # a looped depth calling its layers in another order than found (`hf.looped`)
            raise
        except Exception:  # noqa: BLE001 - a model whose later parts need its layers' real outputs
            return
    order = [i for i, *_ in log]
    where = f"{engine.info.path}: its forward"
    if order != list(range(n)):
        repeated = sorted({i for i in order if order.count(i) > 1})
        what = (f"calls decoder layers {', '.join(map(str, repeated[:6]))} more than once ({len(order)} calls "
                f"for {n} layers: a looped depth)" if repeated else f"calls its decoder layers in the order "
                f"{order[:8]}")
        raise FFNQuantError(f"{where} {what}; the engine runs each decoder layer once, in order, on the previous "
                            "one's output, and would measure another model")
    plain = engine._record(ids, n)  # each call as the forward makes it with every layer returning its input
    for k in range(1, len(log)):
        before, after = log[k - 1][2], log[k][1]
        if before.shape != after.shape or not torch.equal(before, after) or _moved(log[k][3:], plain[k][1:]):
            # it computes between its layers (XLM's attentions and norms beside its FFNs; a looped depth's pass
            # that starts again from an earlier layer's output), or hands a layer more arguments computed from the
            # outputs so far (Inkling 2's block states): each layer's input and call are what the forward computes
            # from the outputs so far (`hf.replay`)
            engine.replay = True
            return

def _moved(call: tuple, plain: tuple) -> bool:
    """Whether a call's other arguments (args, kwargs) differ from the same call's with every layer returning its
    input: the forward computes them from the layers' outputs. A layer's second output handed on is left to
    `find_carried`."""
    from .graph import _tensors

    mine, theirs = _tensors(list(call)), _tensors(list(plain))
    return len(mine) == len(theirs) and any(
        a.shape == b.shape and a.is_floating_point() and not torch.equal(a, b) for a, b in zip(mine, theirs))


def base_runs_the_stack(engine: Any, ids: torch.Tensor, n: int) -> bool:
    """Whether the base module (the first ancestor of the layers taking input_ids) hands the first layer what the
    whole model's forward does: BLT's local encoder takes input_ids too, but the model gives it hash n-gram
    embeddings of its own; where it does not, the engine runs the whole model's forward up to each layer."""
    try:
        first = engine._record(ids, n)[0][0]
    except Exception:  # noqa: BLE001 - a few tokens the base cannot run (a minimum length): not judged so
        return True
    inside = {id(m) for m in beside(engine.base, engine.blocks)}
    # read a layer at a time, what the whole forward runs before its layers is not read yet (the head, which
    # it does not reach, is left to `hf.head`)
    outside = [m for m in beside(engine.model, engine.blocks) if id(m) not in inside
               and not any(x is engine.head for x in m.modules()) and any(p.is_meta for p in m.parameters())]
    for module in outside:
        engine.onload(module)
    engine.runner, base = engine.model, engine.runner
    try:
        whole = engine._record(ids, n)[0][0]
        same = first.shape == whole.shape and torch.equal(first, whole)
    except Exception:  # noqa: BLE001 - the whole model cannot be run so: the base it is
        same = True
    finally:
        engine.runner = base
    for module in outside if same else ():  # not needed after all
        engine.offload(module)
    return same

class _Ending(StandIn):
    """A stand-in returning its input moved by `shift` plus its call's number, the last call a fixed tensor instead
    (`output_reads_more`)."""

    def __init__(self, count: list[int], n: int, shift: float, as_tuple: bool) -> None:
        super().__init__(None, as_tuple=as_tuple)
        self.count, self.n, self.shift = count, n, shift

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.count[0] += 1
        last = self.count[0] == self.n
        if hidden_states.is_floating_point():
            self.hidden = torch.full_like(hidden_states, 0.5) if last else hidden_states + self.shift + self.count[0]
        return super().forward(hidden_states, *args, **kwargs)


def output_reads_more(engine: Any, ids: torch.Tensor, n: int) -> bool:
    """Whether the stack's output (the module running the layers) reads more than its last layer's output: Inkling
    2's final input mixes its first layer's input (the block states it keeps) in, where the engine's head gives the
    forward only the last hidden states. Two forwards on other token ids whose layers answer differently, but for
    the last one, which answers the same: where the outputs differ, the streams are replayed (`hf.replay`). A
    forward that cannot run so is not judged."""
    def final(shift: float, tokens: torch.Tensor) -> torch.Tensor | None:
        count = [0]
        stand_ins = [_Ending(count, n, shift, engine._tuple_out) for _ in range(n)]
        with engine._stand_ins(stand_ins), torch.no_grad():
            out = engine.runner(input_ids=tokens, use_cache=False)
        out = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", None)
        return out if isinstance(out, torch.Tensor) else None

    try:
        one, two = final(1.0, ids), final(100.0, torch.where(ids > 0, ids - 1, ids + 1))
    except FFNQuantError:
        raise
    except Exception:  # noqa: BLE001 - a forward that cannot run on such stand-ins: not judged
        return False
    return one is not None and two is not None and one.shape == two.shape and not torch.equal(one, two)


def head_runs_from(engine: Any, ids: torch.Tensor, n: int) -> bool:
    """Whether the model's head runs from the last hidden states alone, its forward given only their shape
    (`hf.head`), tried on a few tokens (`ids`); where it does not (BLT's byte decoder reads its encoder's states,
    and its forward takes no inputs_embeds), the streams are replayed from the ids (`hf.replay`)."""
    try:
        hidden = engine._record(ids, n)[-1][0]
    except Exception:  # noqa: BLE001 - a few tokens the model cannot run (a minimum length): not judged so
        return True
    engine._ids_shapes[tuple(hidden.shape)] = tuple(ids.shape)
    # read a layer at a time, the head is read for the check and let go after, as it was (a tied head's weight
    # is the embedding's then, which the engine may free before the head's turn: the head reads it again then)
    kept = {name: getattr(engine.head, name, None) for name in ("weight", "bias")}
    try:
        with torch.no_grad():
            engine._head(hidden)
    except (Stop, FFNQuantError):
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own forward refusing the head's call
        if not raised_in_transformers(exc):
            raise
        return False
    finally:  # let go, as it was, whether the model took the call or not
        for name, value in kept.items():
            if isinstance(value, torch.nn.Parameter) and value.is_meta:
                setattr(engine.head, name, value)
    return True
