"""The files an export writes beside the weights: the tokenizer's and generation_config.json.

    files = side_files(tokenizer, hf_folder)     # {name: content}; FolderFileError names a bad file
    files["generation_config.json"] = generation_config(files.get("generation_config.json"), hf_config)

They come from the HF folder the job started from (SIDE_FILES: the tokenizer, its config and
special tokens, the chat template newer transformers keeps in `chat_template.jinja`, and
`generation_config.json`), then from the job's own tokenizer file and its companions (what
trained), over them. Each is read with `flashcp.titan.hf.files.read_member`: a regular file inside
its folder, at most MAX_SIDE_BYTES, anything else refused by name, so an export never carries a
file a link points to outside the folder; the export writes each anew from its content, with the
permissions of a new file. The source's generation_config.json must be a JSON object of finite
values whose keys transformers reads have the types it needs (`check_generation`); a bad one is
refused naming the key. The launcher runs the same reads before a job that exports at its end
starts (`flashcp.titan.launch.preflight`).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from flashcp.titan.hf.files import FolderFileError, load_json, read_member

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
SIDE_FILES = (*TOKENIZER_FILES, "added_tokens.json", "chat_template.jinja", "chat_template.json", "vocab.json",
              "merges.txt", "vocab.txt", "spiece.model")  # fmt: skip
GENERATION = "generation_config.json"
# A tokenizer's largest file: tokenizer.json of a 256K-token vocabulary is about 35 MB.
MAX_SIDE_BYTES = 64 << 20

# The keys of generation_config.json that transformers reads, by the type it needs.
_FLOATS = ("temperature", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty",
           "encoder_repetition_penalty", "length_penalty", "diversity_penalty")  # fmt: skip
_POSITIVE_INTS = ("max_length", "max_new_tokens", "num_beams", "num_beam_groups", "num_return_sequences")
_INTS = ("min_length", "min_new_tokens", "top_k", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size")
_TOKEN_IDS = ("bos_token_id", "pad_token_id", "decoder_start_token_id")
_BOOLS = ("do_sample", "use_cache", "output_scores", "output_attentions", "output_hidden_states", "output_logits",
          "return_dict_in_generate", "renormalize_logits", "remove_invalid_values")  # fmt: skip
_FRACTIONS = ("top_p", "min_p", "typical_p")  # in [0, 1]
_POSITIVE_FLOATS = ("temperature", "repetition_penalty")

logger = logging.getLogger(__name__)


def side_files(tokenizer: str | None, source: str | None) -> dict[str, bytes]:
    """{name: content}: the tokenizer-side files of the HF folder the job started from (and its
    generation_config.json, checked), then the job's tokenizer file and its companions over them.
    A folder or tokenizer that no longer exists is reported and left out; a file that must not be
    carried is FolderFileError naming it."""
    files = {}
    if source and not Path(source).is_dir():  # the weights are what matters; say what is missing
        logger.warning(f"the HF folder {source} the job started from (recorded in the checkpoint) no longer "
                       "exists: exported without its tokenizer-side files and generation_config.json")  # fmt: skip
    elif source:
        files |= _present(Path(source), (*SIDE_FILES, GENERATION))
        if GENERATION in files:
            check_generation(files[GENERATION], Path(source) / GENERATION)
    if tokenizer and not Path(tokenizer).is_file():
        logger.warning(f"the job's tokenizer {tokenizer} (recorded in the checkpoint) no longer exists: exported "
                       "without it")  # fmt: skip
    elif tokenizer:
        path = Path(tokenizer)
        files |= _present(path.parent, TOKENIZER_FILES)
        files["tokenizer.model" if path.suffix == ".model" else "tokenizer.json"] = read_member(
            path.parent, path.name, MAX_SIDE_BYTES)  # fmt: skip
    return files


def _present(folder: Path, names: tuple[str, ...]) -> dict[str, bytes]:
    """The named files that exist in `folder` (a link counts, and must pass `read_member`)."""
    return {name: read_member(folder, name, MAX_SIDE_BYTES) for name in names if os.path.lexists(folder / name)}


def check_generation(content: bytes, where: Path) -> dict[str, Any]:
    """The parsed generation_config.json; FolderFileError naming the first value transformers could
    not use: not a JSON object (or one nested deeper than JSON needs), a non-finite number anywhere,
    or a key it reads of the wrong type or range."""
    config = load_json(content, where)
    if not isinstance(config, dict):
        raise FolderFileError(f"{where} holds a JSON {type(config).__name__}, not an object: fix or remove it")
    for key, value in config.items():
        problem = _non_finite(value) or _wrong_type(key, value)
        if problem:
            raise FolderFileError(f"{where}: {key} = {json.dumps(value)[:80]} {problem}; fix or remove the key")
    return config


def _non_finite(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number"
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return next((p for p in map(_non_finite, items) if p), None)


def _wrong_type(key: str, value: Any) -> str | None:
    """What transformers would not accept in `key`, or None (null: unset, as transformers reads it)."""
    if value is None:
        return None
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    integer = isinstance(value, int) and not isinstance(value, bool)
    if key in _FLOATS and not number:
        return "is not a number"
    if key in _FRACTIONS and not 0 <= value <= 1:
        return "is not in [0, 1]"
    if key in _POSITIVE_FLOATS and value <= 0:
        return "is not positive"
    if key in _POSITIVE_INTS and not (integer and value > 0):
        return "is not a positive integer"
    if key in _INTS and not (integer and value >= 0):
        return "is not a non-negative integer"
    if key in _TOKEN_IDS and not (integer and value >= 0):
        return "is not a token id (an integer >= 0)"
    if key == "eos_token_id" and not _token_ids(value):
        return "is not a token id or a non-empty list of token ids"
    if key in _BOOLS and not isinstance(value, bool):
        return "is not true or false"
    return None


def _token_ids(value: Any) -> bool:
    ids = value if isinstance(value, list) and value else [value]
    return all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)


def generation_config(source: bytes | None, hf_config: dict[str, Any]) -> bytes:
    """generation_config.json: the source's (sampling defaults, extra EOS ids; checked by
    `side_files`) with the trained model's BOS, and its EOS ids first, or one holding only those
    when the source had none."""
    config = json.loads(source) if source else {}
    if "bos_token_id" in hf_config:
        config["bos_token_id"] = hf_config["bos_token_id"]
    if hf_config.get("eos_token_id") is not None:
        eos = [*_ids(hf_config["eos_token_id"])]
        eos += [i for i in _ids(config.get("eos_token_id")) if i not in eos]
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return json.dumps(config, indent=2).encode()


def _ids(value: Any) -> list[Any]:
    """An id or a list of ids as a list (None: none)."""
    return list(value) if isinstance(value, list) else [] if value is None else [value]
