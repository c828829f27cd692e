"""Calibration and evaluation tokens: seeded synthetic sources and validated token files.

Synthetic sources generate rows in fixed chunks, each chunk seeded from (seed, stream,
chunk index), so `tokens(n)` equals the concatenation of `batches(n, bs)` for any batch
size and a source can stream any number of tokens in bounded memory.

Calibration/evaluation separation (`calibration_and_eval`):
- synthetic sources: calibration reads stream 0, evaluation stream 1 of the same seed, so
  the tokens differ (independent random streams) while the source's fixed structure (the
  LLM-like outlier channels and per-channel scales) is the same, as it would be for one model;
- files: calibration reads rows [0, n_calib), evaluation rows [n_calib, n_calib + n_eval);
  a file with fewer rows is an error rather than silently overlapping.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from .errors import FFNQuantError, unknown_choice
from .infra.resources import check_memory, os_reason, regular_file

__all__ = [
    "SourceKind",
    "TOKEN_FILE_SUFFIXES",
    "NPY_DTYPES",
    "SAFETENSORS_DTYPES",
    "CHUNK_ROWS",
    "CALIBRATION_STREAM",
    "EVALUATION_STREAM",
    "gaussian_tokens",
    "llm_like_tokens",
    "outlier_channel_indices",
    "load_tokens",
    "TokenSource",
    "calibration_and_eval",
    "parse_source",
]

TOKEN_FILE_SUFFIXES = (".npy", ".safetensors")
# Rows per independently seeded chunk of a synthetic source (the unit of reproducibility).
CHUNK_ROWS = 1024
CALIBRATION_STREAM = 0
EVALUATION_STREAM = 1
# Streams a caller may pick; the tag keeps layout randomness apart from token randomness.
_LAYOUT_TAG = 0x4C41594F  # "LAYO"
_TOKENS_TAG = 0x544F4B53  # "TOKS"


class SourceKind(str, enum.Enum):
    GAUSSIAN = "gaussian"
    LLM_LIKE = "llm_like"
    FILE = "file"

    def __str__(self) -> str:
        return self.value


def _torch_seed(*words: int) -> int:
    # SeedSequence hashes the tuple well: nearby seeds/chunks give unrelated streams.
    return int(np.random.SeedSequence([int(w) & 0xFFFFFFFF for w in words]).generate_state(2, np.uint64)[0] >> 1)


def _check_sizes(n_tokens: int, d_model: int) -> None:
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
        raise FFNQuantError(f"number of tokens must be a non-negative integer, got {n_tokens!r}")
    if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model <= 0:
        raise FFNQuantError(f"d_model must be a positive integer, got {d_model!r}")


def _check_token_memory(start: int, stop: int, d_model: int, extra_bytes: int = 0) -> None:
    """Refuse drawing rows [start, stop) of a synthetic source the machine cannot hold, before drawing."""
    n_chunks = (stop - 1) // CHUNK_ROWS - start // CHUNK_ROWS + 1 if stop > start else 0
    # Whole chunks are drawn (the rows kept are views into them) and then concatenated.
    check_memory(
        (n_chunks * CHUNK_ROWS + (stop - start)) * d_model * 4 + extra_bytes,
        f"drawing {stop - start} tokens at d_model {d_model} (in chunks of {CHUNK_ROWS})",
        "choose a smaller d_model or fewer tokens",
    )


def _gaussian_rows(start: int, stop: int, d_model: int, seed: int, stream: int) -> torch.Tensor:
    """Rows [start, stop) of the standard-normal stream (seed, stream), built chunk by chunk."""
    if stop <= start:
        return torch.empty(0, d_model)
    _check_token_memory(start, stop, d_model)
    parts = []
    for chunk in range(start // CHUNK_ROWS, (stop - 1) // CHUNK_ROWS + 1):
        gen = torch.Generator().manual_seed(_torch_seed(_TOKENS_TAG, seed, stream, chunk, d_model))
        block = torch.randn(CHUNK_ROWS, d_model, generator=gen)
        lo = max(start - chunk * CHUNK_ROWS, 0)
        hi = min(stop - chunk * CHUNK_ROWS, CHUNK_ROWS)
        parts.append(block[lo:hi])
    return torch.cat(parts) if len(parts) > 1 else parts[0].contiguous()


def gaussian_tokens(n_tokens: int, d_model: int, seed: int = 0, stream: int = 0, start: int = 0) -> torch.Tensor:
    """[n_tokens, d_model] standard-normal tokens, reproducible from (seed, stream); `start` skips rows."""
    _check_sizes(n_tokens, d_model)
    return _gaussian_rows(start, start + n_tokens, d_model, seed, stream)


def outlier_channel_indices(d_model: int, seed: int, n_outlier_channels: int) -> torch.Tensor:
    """The input channels the LLM-like source makes large: fixed by (seed, d_model), sorted."""
    if not 0 <= n_outlier_channels <= d_model:
        raise FFNQuantError(f"n_outlier_channels must be in [0, d_model={d_model}], got {n_outlier_channels}")
    check_memory(8 * d_model, f"the outlier-channel layout at d_model {d_model}", "choose a smaller d_model")
    gen = torch.Generator().manual_seed(_torch_seed(_LAYOUT_TAG, seed, d_model))
    return torch.sort(torch.randperm(d_model, generator=gen)[:n_outlier_channels]).values


def _llm_layout(d_model: int, seed: int, n_outlier_channels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(channel scales, outlier channel indices, their signs): the source's fixed structure."""
    idx = outlier_channel_indices(d_model, seed, n_outlier_channels)
    gen = torch.Generator().manual_seed(_torch_seed(_LAYOUT_TAG, seed, d_model, 1))
    # Ordinary channels of a residual stream differ mildly in scale (log-normal, sigma 0.25).
    scales = torch.exp(0.25 * torch.randn(d_model, generator=gen))
    signs = torch.where(torch.rand(n_outlier_channels, generator=gen) < 0.5, -1.0, 1.0)
    return scales, idx, signs


def llm_like_tokens(
    n_tokens: int,
    d_model: int,
    seed: int = 0,
    n_outlier_channels: int = 4,
    outlier_scale: float = 50.0,
    stream: int = 0,
    start: int = 0,
) -> torch.Tensor:
    """[n_tokens, d_model] "residual stream" tokens with a few fixed, very large input channels.

    Ordinary channels are N(0, s_c^2) with log-normal per-channel scales s_c (sigma 0.25).
    The `n_outlier_channels` channels (chosen from the seed) carry a systematic, sign-stable
    magnitude like LLM.int8's emergent features: `outlier_scale * (sign_c + 0.5 z)`, so their
    absmax is about 20-40x the median channel's for outlier_scale 50 over a few thousand
    tokens (raise `outlier_scale` for the 100x end of what trained LLMs show).
    """
    _check_sizes(n_tokens, d_model)
    if not (isinstance(outlier_scale, (int, float)) and math.isfinite(outlier_scale) and outlier_scale > 0):
        raise FFNQuantError(f"outlier_scale must be a positive number, got {outlier_scale!r}")
    # Before the layout: its permutation and channel scales (16 bytes a channel) take long at huge d_model.
    _check_token_memory(start, start + n_tokens, d_model, extra_bytes=16 * d_model)
    scales, idx, signs = _llm_layout(d_model, seed, n_outlier_channels)
    x = _gaussian_rows(start, start + n_tokens, d_model, seed, stream) * scales
    if len(idx):
        x[:, idx] = float(outlier_scale) * (signs + 0.5 * x[:, idx] / scales[idx])
    return x


def _describe(path: Path) -> str:
    return repr(str(path))


# Token file dtypes load_tokens converts to float32. numpy has no bfloat16; the float8 formats
# are accepted in safetensors because torch converts them exactly. Anything else (float128,
# complex, integers, bool, strings, objects) is refused: torch cannot take it or it is no activation.
NPY_DTYPES = ("float16", "float32", "float64")
SAFETENSORS_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_SAFETENSORS_ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class _Header:
    """What a token file says about its array before any data is read."""

    label: str  # "array" or "tensor 'acts'"
    dtype: str  # numpy / torch dtype name
    shape: tuple[int, ...]
    itemsize: int
    supported: tuple[str, ...] | None  # None: dtype accepted; else the accepted ones (dtype refused)


def _npy_header(path: Path) -> tuple[_Header, int]:
    """The header of a .npy file and the bytes of data after it, read without loading the array."""
    fmt = np.lib.format
    try:
        with open(path, "rb") as fh:
            version = fmt.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = fmt.read_array_header_1_0(fh)
            else:  # (2, 0), or (3, 0) whose utf-8 header differs from 2.0's only beyond ASCII
                shape, _, dtype = fmt.read_array_header_2_0(fh)
            offset = fh.tell()
    except OSError as exc:
        raise FFNQuantError(f"cannot read token file {_describe(path)}: {os_reason(exc)}") from None
    except Exception as exc:  # numpy raises ValueError for bad magic or headers
        raise FFNQuantError(f"cannot read token file {_describe(path)}: {exc}") from exc
    ok = dtype.kind == "f" and dtype.name in NPY_DTYPES  # either byte order: converted when loaded
    header = _Header("array", dtype.name, tuple(int(n) for n in shape), dtype.itemsize, None if ok else NPY_DTYPES)
    return header, path.stat().st_size - offset


def _load_npy(path: Path, header: _Header, data_bytes: int) -> torch.Tensor:
    numel = math.prod(header.shape)
    if numel * header.itemsize > data_bytes:
        raise FFNQuantError(
            f"token file {_describe(path)} is truncated: its header says {header.dtype} {header.shape} "
            f"({numel * header.itemsize} bytes of data) but {data_bytes} bytes follow it"
        )
    try:
        raw = np.load(path, allow_pickle=False)
    except OSError as exc:
        raise FFNQuantError(f"cannot read token file {_describe(path)}: {os_reason(exc)}") from None
    except Exception as exc:  # numpy raises ValueError/EOFError for corrupt files
        raise FFNQuantError(f"cannot read token file {_describe(path)}: {exc}") from exc
    if not raw.dtype.isnative:  # big-endian data (np.save of '>f4'): torch takes native byte order only
        raw = raw.astype(raw.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(raw))


def _safetensors_header(path: Path, name: str | None) -> tuple[_Header, str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            keys = list(fh.keys())
            if name is None:
                if len(keys) != 1:
                    raise FFNQuantError(
                        f"token file {_describe(path)} holds {len(keys)} tensors; name one of: "
                        + (", ".join(keys) or "(none)")
                    )
                name = keys[0]
            elif name not in keys:
                raise unknown_choice(f"tensor in {_describe(path)}:", name, keys)
            sl = fh.get_slice(name)
            st_dtype, shape = str(sl.get_dtype()), tuple(int(n) for n in sl.get_shape())
    except FFNQuantError:
        raise
    except Exception as exc:  # safetensors raises several types for corrupt headers
        raise FFNQuantError(f"cannot read token file {_describe(path)}: {exc}") from exc
    ok = st_dtype in SAFETENSORS_DTYPES
    header = _Header(f"tensor {name!r}", SAFETENSORS_DTYPES.get(st_dtype, st_dtype.lower()), shape,
                     _SAFETENSORS_ITEMSIZE.get(st_dtype, 1), None if ok else tuple(SAFETENSORS_DTYPES.values()))
    return header, name


def _load_safetensors(path: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(name)
    except Exception as exc:
        raise FFNQuantError(f"cannot read token file {_describe(path)}: {exc}") from exc


def load_tokens(path: str | os.PathLike, d_model: int | None = None, name: str | None = None) -> torch.Tensor:
    """Load float32 tokens [n, d] from .npy or .safetensors ([tokens, d] or [batch, seq, d]), validated.

    Errors (FFNQuantError, naming the file): missing, unreadable or non-regular file, unsupported
    extension, several tensors without `name`, a dtype other than the float ones listed in
    NPY_DTYPES / SAFETENSORS_DTYPES, wrong rank, no tokens, last dimension != `d_model` (when
    given), more data than memory holds, NaN/Inf values (with their counts). Everything but the
    values is checked from the file's header, before its data is read; big-endian data is converted.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in TOKEN_FILE_SUFFIXES:
        raise FFNQuantError(
            f"token file {_describe(path)} has unsupported extension {suffix or '(none)'!r}; valid: "
            + ", ".join(TOKEN_FILE_SUFFIXES)
        )
    regular_file(path, "token file")  # a FIFO would block the read forever
    if suffix == ".npy":
        if name is not None:
            raise FFNQuantError(f"token file {_describe(path)} is .npy and holds one array; a tensor name applies only to .safetensors")
        header, data_bytes = _npy_header(path)
    else:
        header, name = _safetensors_header(path, name)
    where = f"token file {_describe(path)} ({header.label})"
    shape = header.shape
    if header.supported is not None:
        raise FFNQuantError(f"{where} has dtype {header.dtype}; expected floating-point values, one of: "
                            + ", ".join(header.supported))
    if len(shape) not in (2, 3):
        raise FFNQuantError(f"{where} has shape {shape}; expected [tokens, d_model] or [batch, seq, d_model]")
    numel = math.prod(shape)
    if numel == 0:
        raise FFNQuantError(f"{where} is empty (shape {shape})")
    if d_model is not None and shape[-1] != d_model:
        raise FFNQuantError(f"{where} has last dimension {shape[-1]}, expected d_model {d_model}")
    # The data as stored, a byte-swapped or float32 copy, and the NaN/Inf masks.
    check_memory(numel * (2 * header.itemsize + 6), f"{where}, {header.dtype} {shape},",
                 "use a smaller token file", "to load")
    tensor = _load_npy(path, header, data_bytes) if suffix == ".npy" else _load_safetensors(path, name)
    if tuple(tensor.shape) != shape:  # the header and the data disagree: a corrupt file
        raise FFNQuantError(f"cannot read token file {_describe(path)}: header shape {shape}, data {tuple(tensor.shape)}")
    tensor = tensor.reshape(-1, shape[-1]).to(torch.float32)
    finite = torch.isfinite(tensor)
    if not bool(finite.all()):
        n_nan = int(torch.isnan(tensor).sum())
        n_inf = int((~finite).sum()) - n_nan
        rows = int((~finite).any(dim=1).sum())
        raise FFNQuantError(f"{where} has {n_nan} NaN and {n_inf} Inf values (in {rows} of {tensor.shape[0]} tokens)")
    return tensor


@dataclass(frozen=True)
class TokenSource:
    """Where calibration/evaluation tokens come from: a seeded synthetic stream or a file.

    `stream` picks an independent token stream of a synthetic source (0 calibration, 1
    evaluation). For files, rows are read from `row_offset` on, and at most `max_rows` of
    them (None: to the end), which is how calibration and evaluation rows stay disjoint.
    """

    kind: SourceKind = SourceKind.GAUSSIAN
    seed: int = 0
    path: str | None = None
    tensor_name: str | None = None
    n_outlier_channels: int = 4
    outlier_scale: float = 50.0
    stream: int = 0
    row_offset: int = 0
    max_rows: int | None = None

    def __post_init__(self) -> None:
        try:
            kind = SourceKind(getattr(self.kind, "value", self.kind))
        except ValueError:
            raise unknown_choice("token source kind", self.kind, list(SourceKind)) from None
        object.__setattr__(self, "kind", kind)
        for field_name in ("seed", "stream", "row_offset", "n_outlier_channels"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise FFNQuantError(f"{field_name} must be a non-negative integer, got {value!r}")
        if self.max_rows is not None and (isinstance(self.max_rows, bool) or not isinstance(self.max_rows, int) or self.max_rows < 0):
            raise FFNQuantError(f"max_rows must be a non-negative integer or None, got {self.max_rows!r}")
        if not (isinstance(self.outlier_scale, (int, float)) and math.isfinite(self.outlier_scale) and self.outlier_scale > 0):
            raise FFNQuantError(f"outlier_scale must be a positive number, got {self.outlier_scale!r}")
        if kind is SourceKind.FILE:
            if not self.path:
                raise FFNQuantError("a file token source needs a path")
            object.__setattr__(self, "path", str(self.path))
        elif self.path is not None:
            raise FFNQuantError(f"a {kind.value} token source takes no path (got {self.path!r})")

    # --- description -----------------------------------------------------------------
    @property
    def label(self) -> str:
        """A short human description, e.g. 'llm_like(seed=0, 4 outlier channels x50)'."""
        if self.kind is SourceKind.FILE:
            rows = f"rows {self.row_offset}.." + ("" if self.max_rows is None else str(self.row_offset + self.max_rows))
            return f"file {self.path} ({rows})"
        extra = f", stream={self.stream}" if self.stream else ""
        if self.kind is SourceKind.LLM_LIKE:
            return f"llm_like(seed={self.seed}{extra}, {self.n_outlier_channels} outlier channels x{self.outlier_scale:g})"
        return f"gaussian(seed={self.seed}{extra})"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kind"] = self.kind.value
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "TokenSource":
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise FFNQuantError(f"unknown TokenSource field(s) {extra}; valid: {sorted(known)}")
        return cls(**dict(data))

    # --- tokens ------------------------------------------------------------------------
    def _file_rows(self, d_model: int) -> torch.Tensor:
        rows = load_tokens(self.path, d_model=d_model, name=self.tensor_name)
        stop = rows.shape[0] if self.max_rows is None else min(rows.shape[0], self.row_offset + self.max_rows)
        if self.row_offset >= stop:
            raise FFNQuantError(
                f"token file {self.path!r} has {rows.shape[0]} tokens; none left from row {self.row_offset}"
            )
        return rows[self.row_offset : stop]

    def available(self, d_model: int) -> int | None:
        """How many tokens this source can give (None: unbounded synthetic stream); validates files."""
        if self.kind is SourceKind.FILE:
            return int(self._file_rows(d_model).shape[0])
        return self.max_rows

    def _synthetic(self, start: int, n: int, d_model: int) -> torch.Tensor:
        if self.kind is SourceKind.GAUSSIAN:
            return gaussian_tokens(n, d_model, self.seed, stream=self.stream, start=start)
        return llm_like_tokens(
            n, d_model, self.seed, self.n_outlier_channels, self.outlier_scale, stream=self.stream, start=start
        )

    def _check_request(self, n_tokens: int, d_model: int, have: int | None) -> None:
        _check_sizes(n_tokens, d_model)
        if have is not None and n_tokens > have:
            raise FFNQuantError(f"{self.label} has {have} tokens, {n_tokens} were requested")

    def tokens(self, n_tokens: int, d_model: int) -> torch.Tensor:
        """The first `n_tokens` tokens of this source, [n_tokens, d_model] float32."""
        if self.kind is SourceKind.FILE:
            rows = self._file_rows(d_model)
            self._check_request(n_tokens, d_model, rows.shape[0])
            return rows[:n_tokens].clone()
        self._check_request(n_tokens, d_model, self.max_rows)
        return self._synthetic(0, n_tokens, d_model)

    def batches(self, n_tokens: int, d_model: int, batch_size: int = 1024) -> Iterator[torch.Tensor]:
        """The same tokens as `tokens(n_tokens, d_model)`, as [<=batch_size, d_model] batches.

        Synthetic sources generate each batch on demand, so memory does not grow with
        `n_tokens`; a file source is loaded and validated once, before the first batch.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise FFNQuantError(f"batch_size must be a positive integer, got {batch_size!r}")
        if self.kind is SourceKind.FILE:
            rows = self._file_rows(d_model)
            self._check_request(n_tokens, d_model, rows.shape[0])
            return (rows[i : min(i + batch_size, n_tokens)] for i in range(0, n_tokens, batch_size))
        self._check_request(n_tokens, d_model, self.max_rows)
        return self._synthetic_batches(n_tokens, d_model, batch_size)

    def _synthetic_batches(self, n_tokens: int, d_model: int, batch_size: int) -> Iterator[torch.Tensor]:
        # Generate whole chunks once and cut batches from them, so small batches do not
        # regenerate a chunk each; at most one chunk plus one batch is held.
        pending: list[torch.Tensor] = []
        held = 0
        for start in range(0, n_tokens, CHUNK_ROWS):
            pending.append(self._synthetic(start, min(CHUNK_ROWS, n_tokens - start), d_model))
            held += pending[-1].shape[0]
            while held >= batch_size or (held and start + CHUNK_ROWS >= n_tokens):
                block = torch.cat(pending) if len(pending) > 1 else pending[0]
                take = min(batch_size, held)
                yield block[:take]
                pending, held = ([block[take:]] if take < held else []), held - take


def calibration_and_eval(
    source: TokenSource, n_calib: int, n_eval: int, d_model: int
) -> tuple[TokenSource, torch.Tensor]:
    """(calibration source limited to `n_calib` tokens, evaluation tokens [n_eval, d]), guaranteed disjoint.

    Synthetic: calibration is stream 0 and evaluation stream 1 of the same seed (same
    outlier-channel layout, independent tokens). File: rows [0, n_calib) calibrate and rows
    [n_calib, n_calib + n_eval) evaluate; a file with fewer rows is an error.
    """
    _check_sizes(n_calib, d_model)
    _check_sizes(n_eval, d_model)
    if source.kind is SourceKind.FILE:
        have = source.available(d_model)
        if n_calib + n_eval > have:
            raise FFNQuantError(
                f"token file {source.path!r} has {have} tokens from row {source.row_offset}; "
                f"{n_calib} calibration + {n_eval} evaluation tokens need {n_calib + n_eval}"
            )
        calib = dataclasses.replace(source, max_rows=n_calib)
        evaluation = dataclasses.replace(source, row_offset=source.row_offset + n_calib, max_rows=n_eval)
    else:
        calib = dataclasses.replace(source, stream=CALIBRATION_STREAM, max_rows=n_calib)
        evaluation = dataclasses.replace(source, stream=EVALUATION_STREAM, max_rows=n_eval)
    return calib, evaluation.tokens(n_eval, d_model)


def parse_source(text: str, seed: int = 0, n_outlier_channels: int = 4, outlier_scale: float = 50.0) -> TokenSource:
    """A TokenSource from CLI text: 'gaussian', 'llm_like', 'file:PATH' or a path ending .npy/.safetensors.

    A file path may name a tensor of a .safetensors file as 'PATH::NAME'.
    """
    raw = str(text).strip()
    key = raw.lower().replace("-", "_")
    if key == SourceKind.GAUSSIAN.value:
        return TokenSource(SourceKind.GAUSSIAN, seed=seed)
    if key == SourceKind.LLM_LIKE.value:
        return TokenSource(SourceKind.LLM_LIKE, seed=seed, n_outlier_channels=n_outlier_channels, outlier_scale=outlier_scale)
    path = raw[len("file:"):] if raw.lower().startswith("file:") else raw
    name = None
    if "::" in path:
        path, name = path.split("::", 1)
    if raw.lower().startswith("file:") or path.lower().endswith(TOKEN_FILE_SUFFIXES):
        if not path:
            raise FFNQuantError("token source 'file:' needs a path, e.g. file:tokens.npy")
        return TokenSource(SourceKind.FILE, seed=seed, path=path, tensor_name=name or None)
    raise unknown_choice("token source", raw, ["gaussian", "llm_like", "file:PATH", "PATH.npy", "PATH.safetensors"])
