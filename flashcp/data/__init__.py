"""Data for planning and training: document-length samplers, the window packer, the token store and
global-batch balancing (numpy only)."""

from flashcp.data.balance import balance_step, Piece, WindowCost
from flashcp.data.lengths import (
    DISTRIBUTIONS,
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
