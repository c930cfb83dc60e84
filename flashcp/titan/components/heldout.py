"""The held-out data a validation reads: `[validation] source`, read like the training data.

Kept apart from `flashcp.titan.components.validate` (which needs TorchTitan) because the launcher opens the
held-out source before any rank starts, as it opens the training data.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashcp.data.sources import DATA_DIR, DataConfig

# The shipped corpus's held-out split: documents chosen by a hash of their id, never in train.jsonl.gz.
DEFAULT_HELDOUT = DATA_DIR / "default" / "valid.jsonl.gz"


def held_out_data(cfg: dict[str, Any]) -> DataConfig | None:
    """The job's held-out `DataConfig` (None: no `[validation] source`).

    `[validation] source` takes the forms of `[data] source`, "default" being the shipped held-out
    split; it is one source, never `[data]`'s mixture. Tokenizer, BOS / EOS, packing and the reading
    settings are `[data]`'s, so held-out windows are built exactly as training windows are.
    `hf_split` names the hub split to read.
    """
    val = cfg["validation"]
    if val["source"] is None:
        return None
    source = str(DEFAULT_HELDOUT) if val["source"] == "default" else val["source"]
    return dataclasses.replace(DataConfig(**cfg["data"]), source=source, hf_split=val["hf_split"], mix={})
