"""What a compressed-tensors folder's files hold, read back without transformers: its tensors by the names stored
and the names transformers loads them as (`safetensors_reader`), every quantized module's weight decompressed by
compressed-tensors itself (`decompressed_weights`), and the proof's two checks on the files: every FFN weight
against ffnquant's dequantized reference bit for bit (`weights_check`), every static input range exactly
(`input_qparams_check`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import FFNQuantError
from ..infra.atomic import write_text

if TYPE_CHECKING:  # annotations only
    from .planned import PlannedModel

__all__ = ["safetensors_reader", "rewrite_shards", "concatenated_for_loader", "decompressed_weights", "stored_as",
           "weights_check", "input_qparams_check"]


def safetensors_reader(folder: Path):
    """name -> tensor over the folder's safetensors files (one or several shards), each tensor also under the name
    transformers loads it as (a checkpoint saved under legacy names, EXAONE's transformer.h.N.mlp.c_fc_0, is read
    by the model's module names, model.layers.N.mlp.gate_proj)."""
    from safetensors import safe_open

    from ..hf.conversions import mapping_for
    from ..hf.weights import loaded_names

    handles = {}
    where: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                where[key] = path
    model_type = json.loads((folder / "config.json").read_text()).get("model_type", "")
    # without transformers' conversion mappings, the stored names only
    stored = {loaded: key for loaded, key in loaded_names(list(where), mapping_for(model_type)).items()
              if loaded not in where}
    where.update({loaded: where[key] for loaded, key in stored.items()})

    def read(name: str) -> torch.Tensor:
        path = where[name]
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path].get_tensor(stored.get(name, name))

    read.aliases = stored  # the loaded names added beside the stored ones
    return where, read


def rewrite_shards(folder: Path, edits: dict[Path, dict[str, Any]]) -> None:
    """Each safetensors file of `edits` rewritten: its `drop` tensors removed, its `add` ones added, after checking
    that each `expect` tensor is in it as given; the shards' index follows."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for path, edit in edits.items():
        with safe_open(str(path), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
            metadata = f.metadata()
        for name, want in edit["expect"].items():
            if not torch.equal(tensors[name].float(), want.float()):
                raise FFNQuantError(f"transformers saved {name!r} as another tensor than ffnquant's expert weight: the "
                                    "checkpoint's expert names do not map to the model's fused experts as ffnquant "
                                    "reads them")
        for name in edit["drop"]:
            del tensors[name]
        tensors.update(edit["add"])
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata or {"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        doc = json.loads(index.read_text())
        for path, edit in edits.items():
            for name in edit["drop"]:
                doc["weight_map"].pop(name, None)
            doc["weight_map"].update({key: path.name for key in edit["add"]})
        write_text(index, json.dumps(doc, indent=2, sort_keys=True) + "\n")


def shared_modules(planned: PlannedModel) -> dict[str, str]:
    """{module: the module whose weights it holds} for the FFN Linears of layers that call an earlier layer's FFN
    (`LayerInfo.shares`, Zamba's shared transformer). transformers ties what the model held before compressed-tensors
    replaced its Linears (a `weight`: int8 codes are stored once, under the first call's name); a packed weight's
    tensors and every quantizer's scales are saved under each call's names, the same values."""
    shares = {layer.index: layer.shares for layer in planned.info.layers if layer.shares is not None}
    first = {(mq.index, mq.weight, mq.expert): mq.module for mq in planned.modules}
    # a looped depth's later call is the first call's very module (one name): nothing held elsewhere
    return {mq.module: first[(shares[mq.index], mq.weight, mq.expert)] for mq in planned.modules
            if mq.index in shares and (shares[mq.index], mq.weight, mq.expert) in first
            and first[(shares[mq.index], mq.weight, mq.expert)] != mq.module}


def concatenated_for_loader(folder: Path, model: Any) -> list[str]:
    """Float tensors transformers concatenates as it loads (Kimi Linear's and OLMo hybrid's q/k/v_conv1d into
    conv1d, a `WeightConverter` of one Concatenate) written concatenated under the loaded name, as the model holds
    them; returns the names written. Measured with transformers 5.25: with a quantization config, its loader finds
    none of the sources ("Concatenate on tensors destined for ...conv1d.weight. Ckpt contains: 0") and refuses the
    folder, while it reads the concatenated tensor under the loaded name as any other."""
    from safetensors import safe_open

    from ..hf.conversions import conversion_mapping

    where, read = safetensors_reader(folder)
    stored = {k: v for k, v in where.items() if k not in read.aliases}  # the names the files hold, not the loaded
    edits: dict[Path, dict[str, Any]] = {}
    written = []
    for conv in conversion_mapping(model):
        ops = list(getattr(conv, "operations", []) or [])
        sources = [str(s) for s in getattr(conv, "source_patterns", []) or []]
        targets = [str(t) for t in getattr(conv, "target_patterns", []) or []]
        if (type(conv).__name__ != "WeightConverter" or len(ops) != 1 or type(ops[0]).__name__ != "Concatenate"
                or len(targets) != 1 or len(sources) < 2 or not all(re.fullmatch(r"[A-Za-z0-9_.]+", s) for s in sources)):
            continue
        for key in list(stored):
            if not key.endswith(sources[0]) or not (key == sources[0] or key[: -len(sources[0])].endswith(".")):
                continue
            base = key[: -len(sources[0])]  # under the file's own naming: renamed at load as the rest
            names = [base + s for s in sources]
            if not all(n in stored and stored[n] == stored[key] for n in names):
                continue
            with safe_open(str(where[key]), framework="pt") as f:
                tensors = [f.get_tensor(n) for n in names]
            if not all(t.is_floating_point() for t in tensors):
                continue
            edit = edits.setdefault(where[key], {"drop": set(), "add": {}, "expect": {}})
            edit["drop"].update(names)
            edit["add"][base + targets[0]] = torch.cat(tensors, dim=int(getattr(ops[0], "dim", 0)))
            written.append(base + targets[0])
    if edits:
        rewrite_shards(folder, edits)
    return sorted(written)


def decompressed_weights(folder: str | os.PathLike, reader: Any = None,
                         same_as: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every quantized module's weight decompressed from the folder's files by compressed-tensors itself
    (the format's own compressor per scheme, no transformers involved), by module name; a module sharing another's
    weights (`same_as`, `shared_modules`) read under that one's name, as transformers ties it."""
    same_as = same_as or {}
    try:
        import compressed_tensors  # noqa: F401
    except ImportError as exc:
        raise FFNQuantError(f"compressed-tensors is not installed ({exc}); pip install '.[deploy]' from the ffnquant checkout") from None
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    folder = Path(folder)
    qc = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not qc:
        return {}
    known = set(QuantizationConfig.model_fields)
    config = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k in known})
    where, read = reader or safetensors_reader(folder)
    out: dict[str, torch.Tensor] = {}
    stored = {k.rsplit(".", 1)[0] for k in where}  # every module that has a tensor in the files
    aliases = getattr(read, "aliases", {})
    on_disk = {k.rsplit(".", 1)[0] for k in where if k not in aliases}  # under the files' own names
    for scheme in config.config_groups.values():
        fmt = scheme.format or config.format
        compressor = BaseCompressor.get_value_from_registry(fmt)
        for target in scheme.targets:
            # a `re:` target (the routed experts') names every stored module it matches
            names = sorted(n for n in stored if re.match(target[3:], n)) if target.startswith("re:") else [target]
            for name in names:
                held = same_as.get(name, name)
                prefix = (held if held in stored else stored_as(held, on_disk)) + "."
                state = {k[len(prefix):]: read(k) for k in where if k.startswith(prefix)}
                out[name] = compressor.decompress(state, scheme)["weight"]
    return out


def stored_as(module: str, stored: set[str]) -> str:
    """The stored module name of `module` where the files name it otherwise (a multimodal model's checkpoint keeps
    `language_model.model.layers.N...` for the module `model.language_model.layers.N...`): the one stored name
    sharing its longest tail of components; `module` itself when none or several do. A wrong match cannot pass:
    the weight read is compared with the reference bit for bit."""
    parts = module.split(".")
    for k in range(len(parts) - 1, 1, -1):
        tail = "." + ".".join(parts[-k:])
        hits = [n for n in stored if n.endswith(tail) or n == tail[1:]]
        if len(hits) == 1:
            return hits[0]
    return module


def weights_check(folder: Path, planned: PlannedModel, reader: Any) -> dict[str, Any]:
    """Every FFN weight as compressed-tensors decompresses it from the files (float ones as stored) against
    ffnquant's dequantized reference, bit for bit."""
    same_as = shared_modules(planned)
    stored = decompressed_weights(folder, reader, same_as)
    where, read = reader
    dtype = planned.compute_dtype
    rows, equal = [], 0
    for mq in planned.modules:
        ref = planned.weight_of(mq)
        got = stored.get(mq.module)
        how = "decompressed by compressed-tensors" + (f" (held by {same_as[mq.module]})" if mq.module in same_as else "")
        held = same_as.get(mq.module, mq.module)
        module = held if held + ".weight" in where else stored_as(
            held, {k.rsplit(".", 1)[0] for k in where if k not in getattr(read, "aliases", {})})
        if got is None and module + ".weight" not in where:  # a runtime would initialise it at random
            rows.append({"module": mq.module, "how": "missing from the files", "bit_identical": False,
                         "max_abs_diff": None})
            continue
        if got is None:
            got, how = read(module + ".weight"), "stored float"
        # in the dtype the runtime computes in (a bf16 model's decompressed weights are bf16 values)
        same = bool(got.shape == ref.shape and torch.equal(got.to(dtype), ref.to(dtype)))
        if mq.module in same_as:  # what a later call of a shared FFN stores under its own names: the first's
            copies = _own_copies_equal(mq.module, same_as[mq.module], where, read)
            how += f"; its own {copies[0]} stored tensor(s) {'equal' if copies[1] else 'DIFFER from'} the first call's"
            same = same and copies[1]
        equal += same
        rows.append({"module": mq.module, "how": how, "bit_identical": same,
                     "max_abs_diff": None if same or got.shape != ref.shape else float((got.float() - ref).abs().max())})
    return {"modules": len(rows), "bit_identical": equal, "all_identical": equal == len(rows), "rows": rows}


def _own_copies_equal(module: str, first: str, where: dict, read: Any) -> tuple[int, bool]:
    """(how many tensors `module` stores under its own name, whether each equals `first`'s of the same name)."""
    aliases = getattr(read, "aliases", {})
    own = [k for k in where if k.startswith(module + ".") and k not in aliases]
    twins = [first + k[len(module):] for k in own]
    return len(own), all(t in where and torch.equal(read(k), read(t)) for k, t in zip(own, twins))


def input_qparams_check(planned: PlannedModel, reader: Any) -> dict[str, Any]:
    """Every static input scale and zero point in the files against the range ffnquant calibrated, exactly."""
    where, read = reader
    same_as = shared_modules(planned)
    checked, wrong = 0, []
    for mq in planned.modules:
        if mq.input_mode != "static":
            continue
        r = mq.input_range
        held = same_as.get(mq.module, mq.module)  # a shared FFN's calls read its first call's tensors
        scale = read(held + ".input_scale").float()
        zp_name = held + ".input_zero_point"
        zp = read(zp_name).to(torch.int32) if zp_name in where else torch.zeros_like(scale, dtype=torch.int32)
        want_zp = r.zero_point - 128 if r.qmin == 0 and r.qmax == 255 else r.zero_point
        checked += 1
        if not (torch.equal(scale, torch.full_like(scale, r.scale)) and bool((zp == want_zp).all())):
            wrong.append(mq.module)
    return {"static_inputs": checked, "all_equal": not wrong, "differ": wrong}
