"""The whole data pipeline, from files to batches, usable without TorchTitan.

- settings: `settings` (`DataConfig`, the `[data]` keys, and a mixture's entries checked);
- documents: `sources` (the shipped corpus, local files, hub datasets, synthetic lengths),
  `mixture` (several sources interleaved by token weights into one stream) and `tokenizer` (HF
  `tokenizer.json` or SentencePiece), with `errors.DataError` naming bad data;
- the token store: `prepare` (tokenise once, `python -m flashcp.data.prepare`), `store` (numpy
  memory maps) and `store_source` (a rank reads only its own windows);
- windows: `packing` (documents back to back into windows of exactly C tokens), `balance`
  (global-batch balancing over data-parallel ranks and micro steps), `deferral` (balancing by
  letting long documents wait a bounded number of steps) and `release` (which waiting documents
  a deferral step trains);
- batches: `loader` (the background thread that reads, packs, plans and dispatches, and its
  resumable state);
- `lengths`: document-length distributions for planning studies and synthetic data.

May import: numpy, torch (the loader's tensors), the engine (`flashcp.plan`, `flashcp.dispatch`),
HF `datasets` / `tokenizers` / `sentencepiece` where a source needs them; never TorchTitan or
`flashcp.run` / `flashcp.titan`. Importing the package loads only the numpy modules below.
"""

from flashcp.data.balance import balance_step, Piece, WindowCost
from flashcp.data.lengths import (
    DISTRIBUTIONS,
    HeavyTailed,
    LengthPool,
    LengthSampler,
    LognormalMixture,
    QuantileLengths,
    length_sampler,
    pack_windows,
)
from flashcp.data.store import open_store, StoreError, TokenStore

__all__ = [
    "DISTRIBUTIONS",
    "HeavyTailed",
    "LengthPool",
    "LengthSampler",
    "LognormalMixture",
    "QuantileLengths",
    "length_sampler",
    "pack_windows",
    "balance_step",
    "Piece",
    "WindowCost",
    "open_store",
    "StoreError",
    "TokenStore",
]
