"""Workloads for planning: document-length samplers and the window packer (no torch needed)."""

from flashcp.data.lengths import (
    DISTRIBUTIONS,
    LengthPool,
    LengthSampler,
    LognormalMixture,
    QuantileLengths,
    length_sampler,
    pack_windows,
)

__all__ = [
    "DISTRIBUTIONS",
    "LengthPool",
    "LengthSampler",
    "LognormalMixture",
    "QuantileLengths",
    "length_sampler",
    "pack_windows",
]
