#!/usr/bin/env python
"""Rebuild FlashCP's embedded default corpus and tokenizer under `data/default/`.

Why this corpus: the trainer must run out of the box on any machine with no network, on real
English text whose documents have widely varying lengths (that variety is what FlashCP plans
over). The documentation that ships inside every CPython installation fits: the docstrings of the
standard library and the language-reference topics of `pydoc_data`, all under the PSF License.

What it writes (all byte-for-byte reproducible for a given CPython and `tokenizers` version):
  train.jsonl.gz / valid.jsonl.gz   one document per line: {"id", "source", "text"}
  tokenizer.json                    byte-level BPE (HF `tokenizers`), trained on train only
  tokenizer_config.json             names the BOS/EOS tokens (also read by TorchTitan's loader)
  LICENSE-PSF.txt                   the licence of the text, copied from the interpreter
  manifest.json                     versions used, document/character counts, sha256 of each file

Documents: one per module (module docstring, then each top-level function's signature and
docstring), one per class (class docstring, then each method's signature and docstring) and one
per `pydoc_data.topics` entry. Test packages are skipped, duplicates removed, and documents
shorter than MIN_CHARS dropped. About 2% of documents, chosen by a hash of their id, form the
validation split.

    python scripts/build_default_data.py            # rebuild data/default
    python scripts/build_default_data.py --check    # rebuild to a temp dir, compare with manifest
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import json
import platform
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "data" / "default"
BUILT_WITH_PYTHON = "3.11.7"  # the interpreter whose stdlib produced the shipped files
VOCAB_SIZE = 4096
BOS, EOS = "<|bos|>", "<|eos|>"
MIN_CHARS = 100
VALID_EVERY = 50  # a document is in the validation split when hash(id) % VALID_EVERY == 0
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "__phello__"}


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    return f"{node.name}({ast.unparse(node.args)})"


def _functions(body: list[ast.stmt]) -> Iterator[tuple[str, str]]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield _signature(node), doc


def stdlib_documents(stdlib: Path) -> Iterator[dict[str, str]]:
    """Module and class documents built from the docstrings of the standard library's sources."""
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if SKIP_DIRS.intersection(rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue  # a few stdlib files are deliberately invalid (e.g. lib2to3 fixtures)
        parts = rel.with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        sections = [f"Module {module}", ast.get_docstring(tree) or ""]
        sections += [f"{module}.{sig}\n{doc}" for sig, doc in _functions(tree.body)]
        yield {"id": f"module:{module}", "source": f"stdlib/{rel}", "text": "\n\n".join(sections)}
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                bases = ", ".join(ast.unparse(b) for b in node.bases)
                sections = [f"class {module}.{node.name}({bases})", ast.get_docstring(node) or ""]
                sections += [f"{node.name}.{sig}\n{doc}" for sig, doc in _functions(node.body)]
                yield {
                    "id": f"class:{module}.{node.name}",
                    "source": f"stdlib/{rel}",
                    "text": "\n\n".join(sections),
                }


def topic_documents() -> Iterator[dict[str, str]]:
    """The language-reference topics `help()` shows, one document per topic."""
    from pydoc_data.topics import topics

    for key in sorted(topics):
        yield {"id": f"topic:{key}", "source": "stdlib/pydoc_data/topics.py", "text": topics[key]}


def collect_documents() -> list[dict[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    docs = []
    for doc in [*topic_documents(), *stdlib_documents(stdlib)]:
        text = doc["text"].strip()
        # A module/class with no docstrings is just its header line: too short, dropped here.
        if len(text) < MIN_CHARS or text in seen:
            continue
        seen.add(text)
        docs.append({**doc, "text": text})
    return docs


def is_valid_split(doc_id: str) -> bool:
    return int(hashlib.sha1(doc_id.encode()).hexdigest(), 16) % VALID_EVERY == 0


def write_jsonl_gz(path: Path, docs: list[dict[str, str]]) -> None:
    # mtime=0 and no file name in the header keep the archive byte-for-byte reproducible.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz:
        for doc in docs:
            gz.write((json.dumps(doc, ensure_ascii=False, sort_keys=True) + "\n").encode("utf-8"))


def train_tokenizer(texts: list[str], path: Path) -> None:
    """Byte-level BPE: every byte is in the base alphabet, so no text is ever out of vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path) -> dict:
    import tokenizers

    docs = collect_documents()
    splits = {"train": [], "valid": []}
    for doc in docs:
        splits["valid" if is_valid_split(doc["id"]) else "train"].append(doc)
    out.mkdir(parents=True, exist_ok=True)
    for name, split in splits.items():
        write_jsonl_gz(out / f"{name}.jsonl.gz", split)
    train_tokenizer([d["text"] for d in splits["train"]], out / "tokenizer.json")
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt", out / "LICENSE-PSF.txt")
    files = ["train.jsonl.gz", "valid.jsonl.gz", "tokenizer.json", "tokenizer_config.json", "LICENSE-PSF.txt"]
    manifest = {
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "vocab_size": VOCAB_SIZE,
        "documents": {name: len(split) for name, split in splits.items()},
        "characters": {name: sum(len(d["text"]) for d in split) for name, split in splits.items()},
        "sha256": {name: sha256(out / name) for name in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="output directory (default: data/default)")
    parser.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare hashes")
    args = parser.parse_args(argv)
    if platform.python_version() != BUILT_WITH_PYTHON:
        print(
            f"warning: the shipped corpus was built with Python {BUILT_WITH_PYTHON}; this is "
            f"{platform.python_version()}, whose standard library differs, so the output will too",
            file=sys.stderr,
        )
    if not args.check:
        manifest = build(args.out)
        print(json.dumps({k: manifest[k] for k in ("python", "documents", "characters")}))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        fresh = build(Path(tmp))["sha256"]
    shipped = json.loads((OUT / "manifest.json").read_text())["sha256"]
    bad = sorted(name for name in shipped if fresh.get(name) != shipped[name])
    for name in bad:
        print(f"differs: {name}", file=sys.stderr)
    print("identical" if not bad else f"{len(bad)} file(s) differ from data/default")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
