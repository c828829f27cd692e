"""The tensors of a local model folder by name: safetensors (single or sharded, through their index) opened lazily
with `safetensors.safe_open`, or, only when the caller opts in, pickled checkpoints read with
`torch.load(weights_only=True)`; and the names transformers loads them under where it only renames them."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, Mapping

import torch

from ..errors import FFNQuantError
from ..infra.resources import read_text as read_file_text, regular_file
from .conversions import TENSOR_OPS, plain_pattern, mapping_for

__all__ = ["_Weights", "_PICKLE_SUFFIXES", "Converted", "converted_names", "loaded_names"]

_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def _renamed(key: str, transforms: Any) -> str:
    """`key` after every `WeightRenaming` among `transforms`, in turn, as transformers applies them."""
    for t in transforms:
        if type(t).__name__ == "WeightRenaming":
            key = t.rename_source_key(key)[0]
    return key


def loaded_names(keys: Any, transforms: Any) -> dict[str, str]:
    """{name transformers loads a stored tensor as: its stored name} for the `keys` its conversion mapping's
    renamings (`WeightRenaming` among `transforms`) rename; a key they leave alone is not listed."""
    return {name: key for key in keys for name in [_renamed(key, transforms)] if name != key}




@dataclass(frozen=True)
class Converted:
    """A loaded tensor that transformers makes from stored tensors by its conversion operations: the stored tensor
    of the converter's first source pattern, the others the folder holds beside it (`companions`: pattern ->
    stored name; Inkling 2 Loop's NVFP4 scales), the converter (its patterns and operations), and which of its
    outputs this is."""

    stored: str
    converter: Any
    index: int
    count: int
    companions: tuple[tuple[str, str], ...] = ()

    @property
    def reordering(self) -> bool:
        """Whether the converter only reorders or splits one stored tensor (`TENSOR_OPS`): its outputs' shapes
        follow from the stored one's without reading it."""
        return not self.companions and all(type(op).__name__ in TENSOR_OPS for op in self.converter.operations)

    def outputs(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """Every output of the converter's operations on the stored tensors (by stored name), in its targets'
        order, as transformers computes them, with its own operations (this one is `[index]`)."""
        conv = self.converter
        sources, targets = list(conv.source_patterns), list(conv.target_patterns)
        state: dict[str, Any] = {sources[0]: [tensors[self.stored]]}
        state.update({pattern: [tensors[name]] for pattern, name in self.companions})
        for op in conv.operations:
            state = op.convert(state, source_patterns=sources, target_patterns=targets)
        return list(state.values())

    def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """The loaded shape from the stored one, for a `reordering` converter (a Chunk divides its dimension by the
        number of outputs)."""
        shape = list(stored)
        for op in self.converter.operations:
            if type(op).__name__ == "Chunk":
                shape[op.dim] //= self.count
        return tuple(shape)


def converted_names(keys: Any, transforms: Any) -> dict[str, Converted]:
    """{name transformers loads: Converted} for the `keys` that one of its conversion mapping's `WeightConverter`s
    turns, after its renamings, into as many tensors as it has targets: from the stored tensor of its first source
    pattern and those of its other patterns the folder holds beside it, by transformers' own operations (a
    reordering or split, `TENSOR_OPS`; a dequantization: Inkling 2 Loop's NVFP4 experts). Converters sharded by
    another attribute, or merging many stored tensors into one, are not listed."""
    keys = list(keys)
    stored = set(keys)
    # not a merge of many stored tensors into one (per-expert Linears fused: `*` in its patterns), which
    # `hf.checkpoint` reads per expert
    converters = [t for t in transforms if type(t).__name__ == "WeightConverter"
                  and getattr(t, "source_patterns", ()) and getattr(t, "operations", None)
                  and not any("*" in str(p) for p in t.source_patterns)
                  and all(getattr(op, "num_shards_attribute", None) is None for op in t.operations)]
    out = {}
    for key in keys:
        name = _renamed(key, transforms)
        for conv in converters:
            first, matched = conv.rename_source_key(name)
            if matched is None:
                continue
            sources = list(conv.source_patterns)
            if matched != sources[0]:
                break  # a companion of another stored tensor (a scale): read with it
            own = plain_pattern(sources[0])
            # the other sources' stored names: the same prefix, the pattern's own name (from `key`, the stored one)
            companions = tuple((p, key.replace(own, plain_pattern(p), 1)) for p in sources[1:]
                               if own in key and key.replace(own, plain_pattern(p), 1) in stored)
            targets = list(conv.target_patterns)
            for i, target in enumerate(targets):  # the others named as transformers expands a one-to-many
                loaded = first if i == 0 else first.replace(targets[0], target, 1)
                out[loaded] = Converted(key, conv, i, len(targets), companions)
            break
    return out


def _first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's text, for one-line messages."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


def _weights_only_reason(exc: BaseException) -> str:
    """' (the blocked global)' from torch's multi-line weights-only refusal, or '' when it names none.

    The rest of torch's text is advice to load with weights_only=False, which is the danger refused here.
    """
    text = str(exc)
    m = re.search(r"WeightsUnpickler error: (.*?)(?:\. |\.?$)", text, re.MULTILINE) or \
        re.search(r"^\s*(Trying to load unsupported .*?)\.?$", text, re.MULTILINE)
    return f" ({m.group(1).strip()})" if m else ""


def _check_inside(index: Path, shard: str) -> None:
    """Refuse a shard name that leaves the model folder (absolute, or with '..' climbing out).

    Checked on the name, not with resolve(): the Hugging Face cache links each file of a snapshot
    folder to a blob outside it, and those links are the folder's own files.
    """
    pure = PurePosixPath(shard.replace("\\", "/"))
    if not shard or pure.is_absolute() or PureWindowsPath(shard).drive or ".." in pure.parts:
        raise FFNQuantError(
            f"{str(index)!r} names shard {shard!r}, which is not a file name inside the model folder; "
            "shards must be files in the folder, named relative to it"
        )



class _Weights:
    """Tensor name -> file index over safetensors (single or sharded) or opted-in pickles; lazy reads."""

    def __init__(self, folder: Path, allow_pickle: bool) -> None:
        self.folder = folder
        self.format = "safetensors"
        self.file_of: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        self._pickles: dict[Path, Mapping[str, torch.Tensor]] = {}
        self._alias: dict[str, str] = {}  # a name as transformers loads it -> the stored name (`rename_as_loaded`)
        self._converted: dict[str, Converted] = {}  # a name transformers loads by converting a stored tensor
        self._last_converted: tuple[Any, list[torch.Tensor]] = (None, [])  # the last stored tensor's outputs
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        # lexists, not is_file: a FIFO or unreadable file of these names is refused by name when read,
        # rather than skipped in favour of some other file
        if os.path.lexists(index):
            self._from_index(index)
        elif os.path.lexists(single):
            self._scan_safetensors([single])
        elif sorted(folder.glob("*.safetensors")):
            self._scan_safetensors(sorted(folder.glob("*.safetensors")))
        else:
            pickles = sorted(p for p in folder.iterdir() if p.suffix in _PICKLE_SUFFIXES and not p.is_dir())
            if not pickles:
                raise FFNQuantError(
                    f"{str(folder)!r} has no weights: expected model.safetensors or model.safetensors.index.json"
                )
            if not allow_pickle:
                raise FFNQuantError(
                    f"{str(pickles[0])!r} is a pickled PyTorch checkpoint and unpickling can run arbitrary code; "
                    "ffnquant reads safetensors only: convert it to safetensors, or, if you trust the file, pass "
                    "allow_pickle=True (CLI --allow-pickle) to read it with torch.load(weights_only=True)"
                )
            self.format = "pickle"
            self._scan_pickles(pickles)

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(sorted({p.name for p in self.file_of.values()}))

    def _from_index(self, index: Path) -> None:
        text = read_file_text(index, "safetensors index")
        try:
            data = json.loads(text)
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
            if not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("a weight_map value is not a file name")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise FFNQuantError(f"{str(index)!r} is not a valid safetensors index: {exc}") from exc
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            _check_inside(index, shard)
            if not os.path.lexists(self.folder / shard):
                raise FFNQuantError(f"{str(index)!r} names shard {shard!r}, which is missing from {str(self.folder)!r}")
        self._scan_safetensors([self.folder / s for s in shards])
        for name, shard in weight_map.items():
            if name not in self.file_of:
                raise FFNQuantError(f"{str(index)!r} maps tensor {name!r} to {shard!r}, which does not hold it")

    def _scan_safetensors(self, files: list[Path]) -> None:
        from safetensors import safe_open

        for path in files:
            regular_file(path, "weights file")  # a FIFO would block safe_open forever
            try:
                with safe_open(str(path), framework="pt") as fh:
                    for name in fh.keys():
                        self.file_of[name] = path
                        sl = fh.get_slice(name)
                        self._shapes[name] = tuple(sl.get_shape())
                        self._dtypes[name] = str(sl.get_dtype())
            except Exception as exc:  # safetensors raises its own error types for corrupt headers
                raise FFNQuantError(f"cannot read safetensors file {str(path)!r}: {exc}") from exc

    def _scan_pickles(self, files: list[Path]) -> None:
        import pickle

        for path in files:
            regular_file(path, "weights file")
            try:
                # weights_only: tensors and plain containers only, no arbitrary objects; mmap keeps it lazy
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except pickle.UnpicklingError as exc:
                # torch's own text spans several lines and advises weights_only=False, which is the danger
                raise FFNQuantError(
                    f"{str(path)!r} holds objects that weights-only loading refuses{_weights_only_reason(exc)}, so it "
                    "is not a plain state dict of tensors and is not read; use a safetensors copy of the weights"
                ) from exc
            except Exception as exc:
                raise FFNQuantError(
                    f"cannot read {str(path)!r} with torch.load(weights_only=True): {_first_line(exc)}"
                ) from exc
            if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
                state = state["state_dict"]
            if not isinstance(state, dict):
                raise FFNQuantError(f"{str(path)!r} does not hold a state dict of tensors")
            self._pickles[path] = state
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    self.file_of[name] = path
                    self._shapes[name] = tuple(value.shape)
                    self._dtypes[name] = str(value.dtype).removeprefix("torch.")

    def rename_as_loaded(self, model_type: str) -> bool:
        """Also answer to the names transformers loads the stored tensors under, where its checkpoint conversion
        mapping only renames them (GraniteMoE's block_sparse_moe.input_linear.weight is its
        block_sparse_moe.experts.gate_up_proj, the same tensor): `names` lists those, `get`/`shape`/`path_of` read
        the stored tensor. Whether any name changed."""
        mapping = mapping_for(model_type)  # [] without transformers or its mappings: the stored names only
        self._alias = {name: stored for name, stored in loaded_names(self.file_of, mapping).items()
                       if name not in self.file_of}
        self._converted = {name: c for name, c in converted_names(self.file_of, mapping).items()
                           if name not in self.file_of}
        for name, c in self._converted.items():  # read, shaped and placed as the stored tensor
            self._alias[name] = c.stored
        return self.renamed

    @property
    def renamed(self) -> bool:
        """Whether `rename_as_loaded` gave any tensor another name."""
        return bool(self._alias)

    @property
    def names(self) -> list[str]:
        """Every tensor's name, a renamed one (`rename_as_loaded`) instead of its stored name."""
        renamed = set(self._alias.values())
        return sorted([n for n in self.file_of if n not in renamed] + list(self._alias))

    def has(self, name: str) -> bool:
        """Whether the checkpoint holds `name`, stored so or under the name transformers loads it as."""
        return name in self.file_of or self._alias.get(name) in self.file_of

    def path_of(self, name: str) -> Path:
        return self.file_of[self._alias.get(name, name)]

    def shape(self, name: str) -> tuple[int, ...]:
        shape = self._shapes[self._alias.get(name, name)]
        if name not in self._converted:
            return shape
        conv = self._converted[name]
        # a dequantization's shape is its output's: read (and converted once for every output of the converter)
        return conv.shape(shape) if conv.reordering else tuple(self.get(name).shape)

    def dtype(self, name: str) -> str | None:
        return self._dtypes.get(self._alias.get(name, name))

    def get(self, name: str) -> torch.Tensor:
        if name in self._converted:  # as transformers converts the stored tensor when it loads it
            conv = self._converted[name]
            # a split's outputs are read one after the other (HRM's gate_proj, then up_proj): the stored tensor
            # is read and converted once for all of them
            if self._last_converted[0] != (conv.stored, conv.converter):
                names = [conv.stored, *(n for _, n in conv.companions)]
                self._last_converted = ((conv.stored, conv.converter), conv.outputs({n: self._stored(n) for n in names}))
            return self._last_converted[1][conv.index]
        return self._stored(self._alias.get(name, name))

    def _stored(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        if self.format == "pickle":
            return self._pickles[path][name]
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as fh:
                return fh.get_tensor(name)
        except Exception as exc:
            raise FFNQuantError(f"cannot read tensor {name!r} from {str(path)!r}: {exc}") from exc


# --- layout discovery -----------------------------------------------------------------
