"""The fake world a dry run steps one rank in (`flashcp.titan.dryrun.run`): the fake process group's
environment, the attention kernel registered for fake tensors, and the patches that stand in for the
reads of tensor values fake tensors lack (the experts' routing counts, trunc_normal_'s redraws), with
the offload's host copies counted as host memory. Each is a context manager that undoes itself.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from flashcp.attention import kernels
from flashcp.titan.dryrun.memtrack import CategoryTracker
from flashcp.titan.models.offload import LayerInputOffload

KERNEL = "dryrun"  # the attention backend name the dry run registers while it runs
GPUS_PER_NODE = 8  # the nodes the dry run lays the ranks on (DGX / HGX), fewer where 8 does not divide the world


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """TorchTitan's fake mode reads the world from NGPU / RANK; the process group ends with the run.
    LOCAL_WORLD_SIZE places the ranks on nodes, as torchrun would (`[flashcp] comm = "two_level"`)."""
    names = ("NGPU", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(NGPU=str(world_size), RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(math.gcd(world_size, GPUS_PER_NODE)))  # fmt: skip
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def fake_kernel() -> Iterator[None]:
    """torch's varlen_attn without its CUDA check: fake tensors stay on the CPU, and its fake kernel
    gives FlashAttention-2's shapes (real GPUs run flash-attn's kernel, whose buffers are the same)."""
    torch_ = kernels.BACKENDS["torch"]
    kernels.BACKENDS[KERNEL] = kernels.Backend(KERNEL, lambda q, k: None, torch_.run, torch_.run_lse, torch_.run_backward)
    try:
        yield
    finally:
        del kernels.BACKENDS[KERNEL]


@contextlib.contextmanager
def balanced_routing(cfg: dict[str, Any]) -> Iterator[None]:
    """Expert parallelism's all-to-all splits as if the router spread tokens evenly over the EP ranks.

    TorchTitan's dispatcher copies the exchanged token counts to the host to size the all-to-all,
    values fake tensors lack; here every rank sends and receives tokens x top_k / EP rows to and
    from each EP rank (the balance the router's bias update drives towards). A skewed step's
    receive buffer is larger, up to EP times on one rank (`estimate.moe_bytes`)."""
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    exchange = AllToAllTokenDispatcher._sync_token_count_exchange

    def balanced(self, local_counts: torch.Tensor, global_counts: torch.Tensor, ep: int):
        rows = cfg["training"]["seq_len"] * cfg["training"]["local_batch_size"] // \
            cfg["parallelism"]["context_parallel_degree"] * self.top_k  # fmt: skip
        splits = [rows // ep + (i < rows % ep) for i in range(ep)]
        return global_counts.reshape(-1), splits, splits

    AllToAllTokenDispatcher._sync_token_count_exchange = balanced
    try:
        yield
    finally:
        AllToAllTokenDispatcher._sync_token_count_exchange = exchange


@contextlib.contextmanager
def no_rejection_sampling() -> Iterator[None]:
    """trunc_normal_ redraws until no value is out of bounds (`mask.any()`), which reads values that fake
    tensors lack; the weights' values do not matter here, so initialisation draws a plain normal
    (torch 2.11-2.13 look `_no_grad_trunc_normal_` up at each call)."""
    truncated = torch.nn.init._no_grad_trunc_normal_
    torch.nn.init._no_grad_trunc_normal_ = lambda tensor, mean, std, *args, **kwargs: tensor.normal_(mean, std)
    try:
        yield
    finally:
        torch.nn.init._no_grad_trunc_normal_ = truncated


@contextlib.contextmanager
def host_copies(tracker: CategoryTracker) -> Iterator[None]:
    """The offload's copies to the host (pinned host memory on a GPU; here fake tensors like the rest)
    are counted as host memory, not the GPU's."""
    to_host = LayerInputOffload._to_host

    def counted(self: LayerInputOffload, tensor: torch.Tensor) -> torch.Tensor:
        with tracker.host():
            return to_host(self, tensor)

    LayerInputOffload._to_host = counted
    try:
        yield
    finally:
        LayerInputOffload._to_host = to_host
