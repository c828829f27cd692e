"""Models whose forward calls a decoder layer more than once: a looped depth (Dory runs its recurrent section n times,
Inkling 2 Loop passes its looped layers twice). Their order of calls is found from the model's own forward
(`call_order`, when the FFNs are discovered); each call is then one of ffnquant's layers (L0, L1, ... in call
order), a later call of a layer calling the FFN of its first call again (`LayerInfo.shares`, as Zamba's shared
block), quantized once from every call's inputs and stored once. The engine runs the calls in order (`Calls`: its
decoder layers as the sequence of calls; `dispatching`: each layer's slot answering the call at hand)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from .skeleton import StandIn, base_of

__all__ = ["Calls", "call_order", "dispatching"]

# a tensor of more elements than this is made with torch.empty (pages the system hands over zeroed and untouched:
# a large vocabulary's embedding costs no memory), a smaller one with zeros
_LARGE = 1 << 20


def _materialize(module: nn.Module, skip: nn.Module) -> None:
    """Every parameter and buffer of `module` outside `skip` that is on the meta device made on the CPU: zeros or
    untouched pages (`_LARGE`). Only a stand-in reads what the model computes from them."""
    inside = {id(m) for m in skip.modules()}
    for sub in module.modules():
        if id(sub) in inside:
            continue
        for store in (sub._parameters, sub._buffers):
            for name, t in list(store.items()):
                if isinstance(t, torch.Tensor) and t.is_meta:
                    make = torch.empty if t.numel() > _LARGE else torch.zeros
                    value = make(t.shape, dtype=t.dtype)
                    store[name] = nn.Parameter(value, requires_grad=False) if isinstance(t, nn.Parameter) else value


class _Tally(StandIn):
    def __init__(self, log: list[int], index: int, as_tuple: bool) -> None:
        super().__init__(None, as_tuple=as_tuple)
        self.log, self.index = log, index

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.log.append(self.index)
        return super().forward(hidden_states, *args, **kwargs)


def call_order(model: nn.Module, layers_path: str) -> tuple[int, ...]:
    """The blocks of `layers_path` in the order the model's forward calls them: () where it calls each once, in
    order (nearly every model). Found from one forward on 8 token ids with every block a stand-in returning its
    input and the rest of the model (a skeleton on the meta device: no weight is read) made on the CPU
    (`_materialize`; the model is changed so: call it on a skeleton of its own). () too where that forward cannot
    run so: the engine checks the order again on the real weights (`hf.forward.check_one_pass`)."""
    blocks = model.get_submodule(layers_path)
    runner = base_of(model, layers_path)
    originals = list(blocks)
    try:
        _materialize(runner, blocks)
    except Exception:  # noqa: BLE001 - a module that cannot be made so: not judged here
        return ()
    ids = torch.ones((1, 8), dtype=torch.long)
    for as_tuple in (False, True):  # a loop that unpacks its layers' outputs is answered with tuples
        log: list[int] = []
        for i, block in enumerate(originals):
            stand_in = _Tally(log, i, as_tuple)
            stand_in.__dict__["_layer"] = block  # what the loop reads of its layers (Dory's attention_type)
            blocks[i] = stand_in
        try:
            with torch.no_grad():
                runner(input_ids=ids, use_cache=False)
            break
        except Exception:  # noqa: BLE001 - a forward that cannot run on stand-ins: not judged here
            log = []
        finally:
            for i, block in enumerate(originals):
                blocks[i] = block
    if not log or log == list(range(len(originals))):
        return ()
    return tuple(log)


class Calls(Sequence):
    """The engine's decoder layers as the model's forward calls them: item `v` is the block of call `v`
    (`order[v]`); setting it sets that block's slot in the model's list (a float32 copy while a check runs)."""

    def __init__(self, blocks: nn.ModuleList, order: Sequence[int]) -> None:
        self.blocks, self.order = blocks, tuple(order)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, v: Any) -> Any:
        if isinstance(v, slice):
            return [self.blocks[b] for b in self.order[v]]
        return self.blocks[self.order[v]]

    def __setitem__(self, v: int, module: nn.Module) -> None:
        self.blocks[self.order[v]] = module

    def __iter__(self) -> Iterator[nn.Module]:
        return (self.blocks[b] for b in self.order)

    def modules(self) -> Iterator[nn.Module]:
        """Every module of the blocks, each once (as `nn.Module.modules` of the model's list)."""
        return self.blocks.modules()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.blocks.parameters()


class _Dispatch(nn.Module):
    """In the slot of one block while the model's forward runs: hands each of its calls to the stand-in of that call
    (`dispatching`), counted across every block in the order of the calls."""

    def __init__(self, block: int, layer: nn.Module, counter: list[int], calls: Sequence[nn.Module],
                 order: Sequence[int], where: str) -> None:
        super().__init__()
        self.__dict__.update(_block=block, _layer=layer, _counter=counter, _calls=calls, _order=order, _where=where)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_layer"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        v = self._counter[0]
        if v >= len(self._order) or self._order[v] != self._block:
            raise FFNQuantError(f"{self._where}: its forward called decoder layer {self._block} as call {v}, where "
                                f"the order found of its calls ({list(self._order)[:12]}) has "
                                f"{'none' if v >= len(self._order) else f'layer {self._order[v]}'}: a looped depth "
                                "whose order of calls depends on the input is not run")
        self._counter[0] += 1
        return self._calls[v](*args, **kwargs)


@contextlib.contextmanager
def dispatching(calls: Calls, stand_ins: Sequence[nn.Module], where: str):
    """While active, call `v` of the model's forward is answered by `stand_ins[v]` (each given its block's module,
    for what the loop reads of it): a dispatcher in each block's slot, counting the calls."""
    originals = list(calls.blocks)
    counter = [0]
    for v, module in enumerate(stand_ins):
        module.__dict__["_layer"] = calls[v]
    for b, layer in enumerate(originals):
        calls.blocks[b] = _Dispatch(b, layer, counter, stand_ins, calls.order, where)
    try:
        yield
    finally:
        for b, layer in enumerate(originals):
            calls.blocks[b] = layer
