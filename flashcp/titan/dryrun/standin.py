"""What the dry run puts in place of the files a job names and this machine lacks.

The shipped recipes read a tokenizer, token stores and a Hugging Face folder their user fills in.
The dry run needs none of their contents: the model's size is its flavor's, and a step's memory
depends on the window's document lengths, not on token values. So, for each one absent:

- `[data] tokenizer`: the shipped one (`data/default`); a model sized by its tokenizer (`debugmodel`,
  a custom size without `vocab_size`) then has the shipped tokenizer's vocabulary;
- a local source of `[data]` or of a `[data.mix.NAME]` entry: synthetic documents of the job's
  `synthetic_lengths` (the entry's, else `[data]`'s: wlbllm unless set), the entry's length filter kept;
- `[validation] source`: validation off (the dry run measures a training step and never validates);
- `[checkpoint] initial_load_path`: the model built as the job names it; a Hugging Face import's
  load still planned, against the safetensors headers that model implies (`hfload.py`).

Each says so in one line. Present files, the shipped corpus and hub sources (`hf:`) are read as they
are. A job whose architecture is the absent folder's (no flavor named) has nothing to size: the
config check refuses it in one line.
"""

from __future__ import annotations

import copy
import glob
from pathlib import Path
from typing import Any

from flashcp.data.sources import DATA_DIR, DEFAULT_TOKENIZER
from flashcp.titan.config import model_dims

GLOB = "*?["  # a source holding one of these is a glob (`flashcp.data.sources.data_files`)


def absent(source: str) -> bool:
    """Whether a source value names local files that are not there (shipped and hub sources never)."""
    if source in ("default", "synthetic") or source.startswith("hf:"):
        return False
    return not glob.glob(source) if any(c in source for c in GLOB) else not Path(source).exists()


def with_stand_ins(cfg: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The checked job with a stand-in for each absent file (see the module doc), and one line for each."""
    out, lines = copy.deepcopy(cfg), []
    data, val, ckpt = out["data"], out["validation"], out["checkpoint"]
    if data["tokenizer"] != "default" and not Path(data["tokenizer"]).exists():
        sized = "" if model_dims(cfg)[4] else ", the model's vocabulary with it"
        shipped = DEFAULT_TOKENIZER.relative_to(DATA_DIR.parent)
        lines.append(f"[data] tokenizer {data['tokenizer']} is absent: the shipped tokenizer ({shipped}) "
                     f"stands in{sized}")  # fmt: skip
        data["tokenizer"] = "default"
    sources = {f"[data.mix.{name}]": entry for name, entry in data["mix"].items()} or {"[data]": data}
    for where, entry in sources.items():
        if absent(entry["source"]):
            lengths = entry.get("synthetic_lengths") or data["synthetic_lengths"]
            kept = [f"{key} {entry[key]}" for key in ("min_tokens", "max_tokens") if entry.get(key) is not None]
            lines.append(f"{where} source {entry['source']} is absent: synthetic documents of {lengths} lengths "
                         "stand in" + (f" ({', '.join(kept)} kept)" if kept else ""))  # fmt: skip
            entry["source"] = "synthetic"
    if val["enable"] and val["source"] and absent(val["source"]):
        lines.append(f"[validation] source {val['source']} is absent: validation off (the dry run measures a "
                     "training step and never validates)")  # fmt: skip
        val["enable"] = False
    if ckpt["initial_load_path"] and not Path(ckpt["initial_load_path"]).exists():
        model = out["model"]
        load = ("its load is planned against the headers the model implies" if ckpt["initial_load_in_hf"]
                else "nothing is loaded")  # fmt: skip
        lines.append(f"[checkpoint] initial_load_path {ckpt['initial_load_path']} is absent: {load}, "
                     f"the model is {model['name']} {model['flavor']} as the job names it")  # fmt: skip
        if not ckpt["initial_load_in_hf"]:
            ckpt["initial_load_path"] = None
    return out, lines
