"""Calibration and evaluation documents, and the token windows a model sees them in.

A source is a shipped corpus (`prose`, `code`, or `prose:evaluation` to name the split; ffnquant/data/TEXTS.md),
a plain text file (one document; a form feed, U+000C, separates several), JSONL (one document a line: the
`text` field, or `messages` for a chat), parquet, or a folder written by `datasets`' `save_to_disk`; parquet and
the folder are read through the `datasets` library (`pip install '.[data]'`).

Windows (`document_windows`): a document is tokenized without special tokens and followed by the tokenizer's
EOS; it is cut into windows of at most `seq_len` tokens, each beginning with the tokens the tokenizer puts in
front of a text (its BOS, when it adds one). So every window starts at a document's start or continues it
from where the previous window of the same document stopped, and never packs two documents. Windows are
taken every document's first, then every document's second, ..., so a small budget spans many documents.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, Union

import torch

from ..errors import FFNQuantError, unknown_choice
from ..infra.resources import read_text as read_file_text

__all__ = ["DOMAINS", "SPLITS", "DEFAULT_SEQ_LEN", "MIN_WINDOW", "ShippedCorpus", "TextSource", "shipped_corpora",
           "shipped_corpus", "default_source", "source_items", "source_label", "read_documents", "load_documents",
           "document_text", "special_tokens", "document_windows", "window_batches", "datasets_module"]

DOMAINS = ("prose", "code")
SPLITS = ("calibration", "evaluation")
DEFAULT_SEQ_LEN = 512
# A window shorter than this (a document's last few tokens) tells little and costs a batch of its own.
MIN_WINDOW = 16

# A document: a text, or a chat (a tuple of {"role", "content"} messages) for the chat template.
Document = Union[str, tuple]


@dataclass(frozen=True)
class ShippedCorpus:
    """One split of a shipped corpus: `name` is 'domain:split'; tokens are SmolLM2's, without special tokens."""

    domain: str
    split: str
    documents: int
    tokens: int
    path: Path

    @property
    def name(self) -> str:
        return f"{self.domain}:{self.split}"


@lru_cache(maxsize=1)
def _manifest() -> dict:
    path = Path(str(resources.files("ffnquant") / "data" / "corpora" / "manifest.json"))
    return json.loads(path.read_text(encoding="utf-8"))


def shipped_corpora(split: str | None = None) -> list[ShippedCorpus]:
    """The shipped corpora (every split, or only `split`'s), in DOMAINS order."""
    if split is not None and split not in SPLITS:
        raise unknown_choice("corpus split", split, list(SPLITS))
    root = Path(str(resources.files("ffnquant") / "data" / "corpora"))
    out = []
    for domain in DOMAINS:
        for s in SPLITS:
            entry = _manifest()["corpora"][f"{domain}:{s}"]
            if split in (None, s):
                out.append(ShippedCorpus(domain, s, entry["documents"], entry["tokens"], root / entry["file"]))
    return out


def _split_for(split: str) -> str:
    """The shipped split a use of text reads: calibration for calibration, evaluation for anything held out."""
    return "calibration" if split == "calibration" else "evaluation"


def shipped_corpus(name: str, split: str = "evaluation") -> ShippedCorpus | None:
    """The shipped corpus `name` ('prose', or 'prose:calibration' naming the split) for a use `split`, or None
    when `name` is no corpus name (a file path); an unknown split after the colon is refused."""
    domain, _, which = str(name).partition(":")
    if domain not in DOMAINS:
        return None
    which = which or _split_for(split)
    if which not in SPLITS:
        raise unknown_choice(f"split of the shipped corpus {domain!r}", which, list(SPLITS))
    return next(c for c in shipped_corpora(which) if c.domain == domain)


@dataclass(frozen=True)
class TextSource:
    """Texts (shipped corpus names or files, in order) and how their documents become sequences:
    `chat_template` renders each through the tokenizer's chat template; `text_field` is the JSONL/parquet/
    datasets column holding the text."""

    items: tuple[str, ...]
    chat_template: bool = False
    text_field: str = "text"

    def __post_init__(self) -> None:
        items = tuple(str(i) for i in self.items)
        if not items or not all(i.strip() for i in items):
            raise FFNQuantError("a text source needs at least one corpus name or file")
        if not self.text_field:
            raise FFNQuantError("the text field name must not be empty")
        object.__setattr__(self, "items", items)

    def __str__(self) -> str:
        return ",".join(self.items)


def default_source(split: str) -> str:
    """The shipped corpus a `split` use reads when no text is given: the prose corpus' split (a domain's
    evaluation split when `split` names a domain, e.g. 'code')."""
    return f"{split}:evaluation" if split in DOMAINS else f"prose:{_split_for(split)}"


def source_items(source: Any, split: str) -> list[str]:
    """The corpus names and files of a source: None (the default corpus), a TextSource, a path, a list, or one
    comma-separated string (as the CLI's repeated --text gives them); an existing path is one file even if its
    name holds a comma."""
    if source is None:
        return [default_source(split)]
    if isinstance(source, TextSource):
        return list(source.items)
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    out: list[str] = []
    for item in items:
        if isinstance(item, str) and "," in item and not os.path.exists(item):
            out += [part.strip() for part in item.split(",") if part.strip()]
        else:
            out.append(os.fspath(item))
    if not out:
        raise FFNQuantError(f"no {split} text given")
    return out


def source_label(source: Any, split: str) -> str:
    """How reports name a source: 'prose:calibration (shipped corpus)', 'a.txt + b.jsonl', '... (chat template)'."""
    parts = []
    for item in source_items(source, split):
        corpus = shipped_corpus(item, split) if not os.path.exists(item) else None
        parts.append(f"{corpus.name} (shipped corpus)" if corpus else item)
    chat = isinstance(source, TextSource) and source.chat_template
    return " + ".join(parts) + (" (chat template)" if chat else "")


def datasets_module():
    """The `datasets` library, or a one-line error saying how to install it."""
    try:
        import datasets
    except Exception as exc:  # ImportError, or a broken install raising something else
        raise FFNQuantError(f"reading parquet or a save_to_disk folder needs the datasets library ({type(exc).__name__}: "
                            f"{exc}); pip install '.[data]' from the ffnquant checkout") from None
    return datasets


def _valid_unicode(text: str, where: str) -> str:
    """`text` itself, or a one-line refusal naming where it holds a lone surrogate: JSON's \\ud800-style escapes
    decode to one without its pair, which no UTF-8 tokenizer can read (it failed deep inside the tokenizer)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FFNQuantError(f"{where} holds invalid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at character "
                            f"{exc.start} (an escape such as \\ud800 without its pair); fix or remove it") from None
    return text


def _row_document(row: Any, where: str, text_field: str) -> Document:
    if not isinstance(row, dict):
        raise FFNQuantError(f"{where} is not an object with a {text_field!r} field")
    text = row.get(text_field)
    if isinstance(text, str):
        return _valid_unicode(text, where)
    messages = row.get("messages")
    if isinstance(messages, (list, tuple)) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return tuple({"role": _valid_unicode(m["role"], where), "content": _valid_unicode(m["content"], where)}
                     for m in messages)
    raise FFNQuantError(f"{where} has no text field {text_field!r} (a string) and no 'messages' "
                        f"(a list of role/content objects); its keys: {', '.join(map(str, row)) or 'none'}")


def _jsonl_documents(path: Path, text_field: str) -> list[Document]:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as f:
                lines = f.read().splitlines()
        else:
            lines = read_file_text(path, "JSONL file").splitlines()
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise FFNQuantError(f"cannot read JSONL file {str(path)!r}: {type(exc).__name__}: {exc}") from None
    docs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FFNQuantError(f"{str(path)!r} line {n} is not JSON: {exc.msg}") from None
        docs.append(_row_document(row, f"{str(path)!r} line {n}", text_field))
    return docs


def _dataset_documents(dataset: Any, where: str, text_field: str) -> list[Document]:
    datasets = datasets_module()
    if isinstance(dataset, datasets.DatasetDict):
        if len(dataset) != 1:
            raise FFNQuantError(f"{where} holds the splits {', '.join(dataset)}; save the one to use on its own")
        dataset = next(iter(dataset.values()))
    columns = list(dataset.column_names)
    if text_field not in columns and "messages" not in columns:
        raise FFNQuantError(f"{where} has no column {text_field!r} (nor 'messages'); its columns: "
                            f"{', '.join(columns) or 'none'}")
    return [_row_document(row, f"{where} row {n}", text_field) for n, row in enumerate(dataset)]


def read_documents(item: str | os.PathLike, split: str = "evaluation", text_field: str = "text") -> list[Document]:
    """The documents of one source item: a shipped corpus name, a text/JSONL/parquet file or a datasets folder."""
    path = Path(item)
    if not path.exists():
        corpus = shipped_corpus(str(item), split)
        if corpus is not None:
            return _jsonl_documents(corpus.path, "text")
        shipped = [c.name for c in shipped_corpora()] + list(DOMAINS)
        raise FFNQuantError(f"text {str(item)!r} is neither a file nor a shipped corpus (valid corpora: "
                            f"{', '.join(sorted(set(shipped)))})")
    name = path.name.lower()
    if path.is_dir():
        datasets = datasets_module()
        try:
            dataset = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise FFNQuantError(f"{str(path)!r} is not a folder written by datasets' save_to_disk "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        docs = _dataset_documents(dataset, f"dataset {str(path)!r}", text_field)
    elif name.endswith(".parquet"):
        datasets = datasets_module()
        try:
            dataset = datasets.load_dataset("parquet", data_files=str(path), split="train")
        except Exception as exc:
            raise FFNQuantError(f"datasets cannot read the parquet file {str(path)!r} "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
        docs = _dataset_documents(dataset, f"parquet file {str(path)!r}", text_field)
    elif name.endswith((".jsonl", ".jsonl.gz")):
        docs = _jsonl_documents(path, text_field)
    else:
        text = read_file_text(path, "text file")  # one-line errors: missing, a FIFO, unreadable, not UTF-8
        docs = [d for d in text.split("\f") if d.strip()]
    if not any((d.strip() if isinstance(d, str) else d) for d in docs):
        raise FFNQuantError(f"text {str(path)!r} is empty")
    return docs


def load_documents(source: Any, split: str) -> list[Document]:
    """Every document of a source, its items in order."""
    field = source.text_field if isinstance(source, TextSource) else "text"
    docs: list[Document] = []
    for item in source_items(source, split):
        docs += read_documents(item, split, field)
    return docs


def document_text(doc: Document) -> str:
    """A document as plain text (a chat's messages' contents, a blank line apart)."""
    return doc if isinstance(doc, str) else "\n\n".join(m["content"] for m in doc)


def special_tokens(tokenizer) -> tuple[list[int], list[int]]:
    """(the ids the tokenizer puts before a text, the ids that end a document): its BOS when it adds one
    (Llama, Gemma; not GPT-2 or SmolLM2), and its EOS (else what it appends to a text, e.g. BERT's [SEP])."""
    probe = "a"
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    full = list(tokenizer(probe)["input_ids"])
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), None)
    prefix, suffix = (full[:at], full[at + len(plain):]) if at is not None and plain else ([], [])
    eos = getattr(tokenizer, "eos_token_id", None)
    return prefix, ([int(eos)] if isinstance(eos, int) else suffix)


def _document_ids(tokenizer, doc: Document, chat_template: bool, prefix: list[int], end: list[int]) -> list[int]:
    if not chat_template:
        if not isinstance(doc, str):
            raise FFNQuantError("a document is a chat ('messages'): pass --chat-template to render it through the "
                                "tokenizer's chat template, or give a 'text' field")
        return list(tokenizer(doc, add_special_tokens=False)["input_ids"]) + end
    # the template says how a turn begins and ends; a plain text is one user turn
    messages = list(doc) if not isinstance(doc, str) else [{"role": "user", "content": doc}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    ids = list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    if prefix and ids[:len(prefix)] == prefix:  # the template wrote the BOS itself; the window adds it
        ids = ids[len(prefix):]
    return ids


def _check_chat(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise FFNQuantError("--chat-template: the tokenizer has no chat template (tokenizer_config.json / "
                            "chat_template.jinja); leave the flag off for plain text")


def _windows(tokenizer, documents: Iterable[Document], seq_len: int, chat_template: bool) -> Iterator[list[int]]:
    """Every document's first window, in order, then every document's second window, and so on: a small budget
    covers many documents, each from its start. Documents are tokenized as the first pass reaches them."""
    prefix, end = special_tokens(tokenizer)
    step = seq_len - len(prefix)
    if step < 1:
        raise FFNQuantError(f"seq_len {seq_len} leaves no room after the tokenizer's {len(prefix)} leading token(s)")
    seen: list[list[int]] = []
    for doc in documents:
        ids = _document_ids(tokenizer, doc, chat_template, prefix, end)
        seen.append(ids)
        if ids:
            yield prefix + ids[:step]
    k = 1
    while True:
        rest = [ids for ids in seen if len(ids) > k * step]
        if not rest:
            return
        for ids in rest:
            yield prefix + ids[k * step:(k + 1) * step]
        k += 1


def document_windows(tokenizer, documents: Sequence[Document], seq_len: int, max_tokens: int | None = None,
                     n_samples: int | None = None, chat_template: bool = False,
                     min_window: int = MIN_WINDOW) -> list[list[int]]:
    """The token windows of `documents`, in order, as the model sees text in use (module docstring): at most
    `n_samples` windows and `max_tokens` tokens (the last window cut to what is left). A document's last
    window shorter than `min_window` (or seq_len, if smaller) is left out, unless no other window is left;
    fewer than 2 tokens in all is refused."""
    if seq_len < 2:
        raise FFNQuantError(f"seq_len must be >= 2, got {seq_len}")
    if chat_template:
        _check_chat(tokenizer)
    shortest = min(min_window, seq_len)
    kept: list[list[int]] = []
    short: list[list[int]] = []
    total = 0
    for window in _windows(tokenizer, documents, seq_len, chat_template):
        cut = max_tokens is not None and len(window) > max_tokens - total
        if cut:  # the budget's last window: kept however short, so a budget is met exactly
            window = window[:max_tokens - total]
            if len(window) < 2:  # one token predicts nothing
                break
        elif len(window) < shortest:
            short.append(window)
            continue
        kept.append(window)
        total += len(window)
        if (max_tokens is not None and total >= max_tokens) or (n_samples is not None and len(kept) >= n_samples):
            break
    if not kept:  # only short windows: better than nothing
        kept = [w for w in short if len(w) >= 2][: n_samples or None]
    if sum(len(w) for w in kept) < 2:
        raise FFNQuantError(f"the text gives {sum(len(w) for w in kept)} token(s); at least 2 are needed")
    return kept


def window_batches(windows: Sequence[Sequence[int]], batch_size: int) -> list[torch.Tensor]:
    """[batch, length] tensors of the windows: windows of one length together, `batch_size` at a time, in
    their order; the longest first (so the first batch is the largest, as memory estimates assume)."""
    if batch_size < 1:
        raise FFNQuantError(f"batch_size must be >= 1, got {batch_size}")
    by_length: dict[int, list[Sequence[int]]] = {}
    for w in windows:
        by_length.setdefault(len(w), []).append(w)
    batches = []
    for _, group in sorted(by_length.items(), key=lambda kv: -kv[0]):
        for i in range(0, len(group), batch_size):
            batches.append(torch.tensor([list(w) for w in group[i:i + batch_size]], dtype=torch.long))
    return batches
