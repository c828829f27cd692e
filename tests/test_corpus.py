"""hf.corpus: shipped corpora, documents from every supported source, and windows as the model sees text."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from ffnquant.errors import FFNQuantError
from ffnquant.hf import corpus
from ffnquant.hf.corpus import TextSource, document_windows, load_documents, read_documents, window_batches

pytestmark = pytest.mark.hf
ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"
DOCS = ["the first document is about a whale " * 12, "a second and shorter one", "third: " + "word " * 70]
CHAT = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}")


def _tokenizer(bos: bool, chat: bool = False):
    """The tests' word-level tokenizer; with `bos`, one that puts <s> before a text, as Llama's and Gemma's do."""
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    from tokenizers import processors

    from hf_models import tokenizer

    tok = tokenizer(T)
    if bos:
        tok._tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.convert_tokens_to_ids("<s>"))])
    if chat:
        tok.chat_template = CHAT
    return tok


@pytest.fixture(scope="module", params=[False, True], ids=["no-bos", "bos"])
def tok(request):
    return _tokenizer(request.param)


@pytest.mark.parametrize("seq_len", [8, 32, 512], ids=lambda n: f"seq{n}")
def test_each_window_starts_a_document_or_continues_it_with_bos_and_eos_at_ends(tok, seq_len):
    prefix, end = corpus.special_tokens(tok)
    assert end == [tok.eos_token_id]
    assert prefix == ([tok.bos_token_id] if tok("a")["input_ids"][0] == tok.bos_token_id else [])
    ids = [tok(d, add_special_tokens=False)["input_ids"] + end for d in DOCS]
    step = seq_len - len(prefix)
    windows = document_windows(tok, DOCS, seq_len, min_window=1)
    # every piece of every document, in the round-robin order: first windows of all, then second windows, ...
    expected = [prefix + d[k * step:(k + 1) * step] for k in range(max(len(d) for d in ids) // step + 1)
                for d in ids if len(d) > k * step]
    assert windows == expected
    assert all(w[:len(prefix)] == prefix and len(w) <= seq_len for w in windows)
    assert sum(w[-1] == tok.eos_token_id for w in windows) == len(DOCS)  # one EOS per document end


def test_budget_and_samples_cut_windows_and_short_tails_are_dropped(tok):
    long = document_windows(tok, DOCS, 16)
    assert all(len(w) >= 16 for w in long[:-1])
    assert sum(len(w) for w in document_windows(tok, DOCS, 16, max_tokens=37)) == 37  # the last window cut to fit
    assert len(document_windows(tok, DOCS, 16, n_samples=2)) == 2
    # only short documents: kept rather than nothing
    assert document_windows(tok, ["tiny text"], 64) == [corpus.special_tokens(tok)[0]
                                                      + tok("tiny text", add_special_tokens=False)["input_ids"]
                                                      + [tok.eos_token_id]]


def test_batches_group_equal_lengths_longest_first():
    batches = window_batches([[1] * 4, [2] * 3, [3] * 4, [4] * 4, [5] * 3], 2)
    assert [tuple(b.shape) for b in batches] == [(2, 4), (1, 4), (2, 3)]
    assert batches[0].tolist() == [[1] * 4, [3] * 4]


def _write_sources(tmp_path: Path) -> dict[str, Path]:
    datasets = pytest.importorskip("datasets", reason="datasets not installed (pip install '.[data]')")
    txt = tmp_path / "docs.txt"
    txt.write_text("\f".join(DOCS), encoding="utf-8")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)), encoding="utf-8")
    gz = tmp_path / "docs.jsonl.gz"
    gz.write_bytes(gzip.compress(jsonl.read_bytes()))
    ds = datasets.Dataset.from_dict({"text": DOCS, "id": list(range(len(DOCS)))})
    parquet = tmp_path / "docs.parquet"
    ds.to_parquet(str(parquet))
    folder = tmp_path / "saved"
    ds.save_to_disk(str(folder))
    return {"text": txt, "jsonl": jsonl, "jsonl.gz": gz, "parquet": parquet, "save_to_disk": folder}


@pytest.mark.parametrize("kind", ["text", "jsonl", "jsonl.gz", "parquet", "save_to_disk"])
def test_every_source_kind_gives_the_same_documents(tmp_path, kind):
    assert read_documents(_write_sources(tmp_path)[kind]) == DOCS


def test_chat_template_is_applied_when_asked_and_refused_without_one(tmp_path):
    tok = _tokenizer(bos=True, chat=True)
    chat = [{"role": "user", "content": "hello whale"}, {"role": "assistant", "content": "the sea"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": chat}) + "\n", encoding="utf-8")
    docs = load_documents(TextSource((str(path),), chat_template=True), "calibration")
    [window] = document_windows(tok, docs, 64, chat_template=True)
    rendered = tok(tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
    assert window == rendered  # the template's own <s> is the BOS, not doubled; its </s> ends the document
    [plain] = document_windows(tok, ["hello whale"], 64, chat_template=True)  # a text is one user turn
    user = tok.apply_chat_template([{"role": "user", "content": "hello whale"}], tokenize=False)
    assert plain == tok(user, add_special_tokens=False)["input_ids"] and plain[1] != tok.bos_token_id
    with pytest.raises(FFNQuantError, match="pass --chat-template") as err:
        document_windows(tok, docs, 64)
    assert "\n" not in str(err.value)
    with pytest.raises(FFNQuantError, match="no chat template") as err:
        document_windows(_tokenizer(bos=False), docs, 64, chat_template=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", ["missing", "no-field", "empty", "unknown-corpus", "bad-split", "not-json"])
def test_bad_inputs_are_one_line_errors(tmp_path, case):
    path = tmp_path / "x.jsonl"
    item, match = {
        "missing": (str(tmp_path / "nope.txt"), "neither a file nor a shipped corpus"),
        "no-field": (path, "no text field 'text'"),
        "empty": (tmp_path / "empty.txt", "is empty"),
        "unknown-corpus": ("poetry", "valid corpora: code, code:calibration"),
        "bad-split": ("prose:train", "calibration, evaluation"),
        "not-json": (tmp_path / "bad.jsonl", "line 1 is not JSON"),
    }[case]
    path.write_text(json.dumps({"body": "x"}) + "\n", encoding="utf-8")
    (tmp_path / "empty.txt").write_text("  \n", encoding="utf-8")
    (tmp_path / "bad.jsonl").write_text("{oops\n", encoding="utf-8")
    with pytest.raises(FFNQuantError, match=match) as err:
        read_documents(item, "calibration")
    assert "\n" not in str(err.value)


def test_names_resolve_to_the_split_of_their_use():
    assert corpus.source_label(None, "calibration") == "prose:calibration (shipped corpus)"
    assert corpus.source_label(None, "evaluation") == "prose:evaluation (shipped corpus)"
    assert corpus.source_label("code", "calibration") == "code:calibration (shipped corpus)"
    assert corpus.source_label("code:evaluation", "calibration") == "code:evaluation (shipped corpus)"
    assert corpus.source_label(TextSource(("prose",), chat_template=True), "evaluation").endswith("(chat template)")
    assert [c.name for c in corpus.shipped_corpora("evaluation")] == ["prose:evaluation", "code:evaluation"]


@pytest.mark.parametrize("domain", corpus.DOMAINS)
def test_shipped_splits_share_no_document_and_match_the_manifest(domain):
    cal, ev = (read_documents(f"{domain}:{s}") for s in corpus.SPLITS)
    assert not set(cal) & set(ev)
    sources = {s: {json.loads(line)["source"] for line in gzip.open(corpus.shipped_corpus(domain, s).path, "rt")}
               for s in corpus.SPLITS}
    assert not sources["calibration"] & sources["evaluation"]
    for s, docs in zip(corpus.SPLITS, (cal, ev)):
        assert corpus.shipped_corpus(domain, s).documents == len(docs)


@pytest.mark.skipif(not (SMOLLM2 / "tokenizer.json").is_file(),
                    reason="models/smollm2-135m-instruct is absent (python3 scripts/fetch_trained_llm.py)")
@pytest.mark.parametrize("name", [f"{d}:{s}" for d in corpus.DOMAINS for s in corpus.SPLITS])
def test_each_shipped_corpus_holds_100k_smollm2_tokens(name):
    T = pytest.importorskip("transformers")
    tok = T.AutoTokenizer.from_pretrained(str(SMOLLM2), local_files_only=True)
    n = sum(len(tok(d, add_special_tokens=False)["input_ids"]) for d in read_documents(name))
    assert n >= 100_000
    assert n == next(c for c in corpus.shipped_corpora() if c.name == name).tokens


# --- text input hardening: invalid Unicode and odd rows, in every kind of file --------------------------------------
@pytest.mark.parametrize("line, where", [
    (json.dumps({"text": "a lone \ud800 surrogate"}), "line 2 holds invalid Unicode: a lone surrogate U+D800 at character 7"),
    ('{"text": "low \\udfff half"}', "line 2 holds invalid Unicode: a lone surrogate U+DFFF"),
    (json.dumps({"messages": [{"role": "user", "content": "hi \udbff"}]}), "line 2 holds invalid Unicode"),
], ids=["high-surrogate", "low-surrogate-escape", "in-a-message"])
@pytest.mark.parametrize("gz", [False, True], ids=["jsonl", "jsonl.gz"])
def test_a_lone_surrogate_is_refused_naming_the_file_and_line(tmp_path, line, where, gz):
    from ffnquant.hf.capture import read_text

    text = json.dumps({"text": "a fine first line"}) + "\n" + line + "\n"
    path = tmp_path / ("x.jsonl.gz" if gz else "x.jsonl")
    if gz:
        path.write_bytes(gzip.compress(text.encode("utf-8")))
    else:
        path.write_text(text, encoding="utf-8")
    for read in (lambda: read_documents(path, "calibration"), lambda: read_text(str(path), "calibration")):
        with pytest.raises(FFNQuantError) as err:
            read()
        assert f"{str(path)!r} {where}" in str(err.value) and "\n" not in str(err.value)


def test_surrogate_bytes_in_a_text_file_are_refused_as_not_utf8(tmp_path):
    path = tmp_path / "x.txt"
    path.write_bytes(b"fine text \xed\xa0\x80 then more")  # U+D800 encoded as if it were a character
    with pytest.raises(FFNQuantError, match="x.txt") as err:
        read_documents(path, "calibration")
    assert "\n" not in str(err.value)


_ROWS = {
    "text-null": ({"text": [DOCS[0], None]}, "row 1 has no text field 'text'"),
    "text-a-number": ({"text": [1.5, 2.5]}, "row 0 has no text field 'text'"),
    "no-text-column": ({"body": DOCS}, "has no column 'text' (nor 'messages'); its columns: body"),
}


@pytest.mark.parametrize("case", list(_ROWS), ids=list(_ROWS))
@pytest.mark.parametrize("kind", ["jsonl", "parquet", "save_to_disk"])
def test_odd_rows_are_one_line_errors_in_every_kind(tmp_path, case, kind):
    columns, message = _ROWS[case]
    n = len(next(iter(columns.values())))
    if kind == "jsonl":
        path = tmp_path / "x.jsonl"
        path.write_text("".join(json.dumps({k: v[i] for k, v in columns.items()}) + "\n" for i in range(n)),
                        encoding="utf-8")
        message = message.replace("row 1", "line 2").replace("row 0", "line 1").replace(
            "has no column 'text' (nor 'messages'); its columns: body", "has no text field 'text'")
    else:
        datasets = pytest.importorskip("datasets", reason="datasets not installed (pip install '.[data]')")
        ds = datasets.Dataset.from_dict(columns)
        path = tmp_path / ("x.parquet" if kind == "parquet" else "saved")
        ds.to_parquet(str(path)) if kind == "parquet" else ds.save_to_disk(str(path))
    with pytest.raises(FFNQuantError) as err:
        read_documents(path, "calibration")
    assert message in str(err.value) and "\n" not in str(err.value)
