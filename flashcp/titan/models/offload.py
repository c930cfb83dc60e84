"""Full activation checkpointing's saved layer inputs kept in host memory between forward and backward.

Under full AC each layer keeps only its inputs until backward, yet the residual stream of every
layer is seq_len / cp x dim per rank: 32 GiB at 1M tokens on 8 ranks for Llama 3 8B.
`offload_layer_inputs` hooks each checkpointed block from outside (no new module, so parameter
names stay). While a block runs forward, autograd's saved-tensor hooks receive what the
non-reentrant checkpoint saves of the block: its inputs. The floating-point ones (the residual
stream) go to host memory; the integer ones (positions) are shared by every layer and stay. In
backward, unpacking layer i's input also starts bringing back layer i-1's, so each copy runs
under a layer's recompute and backward. The last layer's input stays: backward needs it first.

On a GPU both copies run on one side stream into / out of pinned memory, ordered with the
compute stream by stream waits and events, never by a host sync; `record_stream` keeps each
tensor's memory until the stream that reads it is done. On CPU the same path copies into a
distinct tensor synchronously, so tests exercise it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.distributed.tensor import DTensor

# Bytes/s each way a pinned host <-> GPU copy sustains on PCIe Gen5 x16: NVIDIA's H100 datasheet gives
# 128 GB/s for both directions (64 each; 32 GT/s x 16 lanes, 128b/130b: 63 GB/s), less protocol overhead.
PCIE_GEN5_X16 = 50e9


@dataclass(eq=False)
class _Saved:
    """One saved input of layer `layer`: its host copy, or while on the device that tensor and the
    event its copy ends with; `before` is the layer before's saved inputs, fetched next. A DTensor
    (tensor parallelism) moves its local shard; `dtensor` rebuilds it."""

    layer: int
    device: torch.device
    before: list[_Saved]
    host: torch.Tensor | None = None
    on_device: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    dtensor: tuple | None = None  # (mesh, placements, shape, stride)


class LayerInputOffload:
    """The offload of one model's layer inputs; `offload_layer_inputs` registers its hooks."""

    def __init__(self) -> None:
        self.stream: torch.cuda.Stream | None = None  # the side stream, made at the first GPU tensor
        self._layer, self._keep = 0, False  # the block running forward, and whether its inputs stay
        self._current: list[_Saved] = []  # its saved inputs
        self._before: list[_Saved] = []  # the saved inputs of the block before it
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None  # while a block runs forward

    def enter(self, layer: int, keep: bool, module: torch.nn.Module, args: Any) -> None:
        """Forward pre-hook of block `layer`: its saves go through this offload."""
        self._before, self._current = (self._current if layer else []), []
        self._layer, self._keep = layer, keep
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """Forward hook: the block's saves are done; after the last block nothing is held here."""
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        if self._keep:
            self._before, self._current = [], []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        if not tensor.is_floating_point():
            return tensor
        saved = _Saved(self._layer, tensor.device, self._before)
        if self._keep:
            saved.on_device = tensor
        else:
            if isinstance(tensor, DTensor):
                saved.dtensor = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
                tensor = tensor.detach().to_local()
            saved.host = self._to_host(tensor.detach())
        self._current.append(saved)
        return saved

    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        gpu = tensor.is_cuda
        if gpu:  # the copy starts once the compute stream has produced the tensor
            self._side_stream(tensor.device).wait_stream(torch.cuda.current_stream(tensor.device))
        with self._on_side(gpu):
            host = torch.empty_like(tensor, device="cpu", pin_memory=gpu)
            host.copy_(tensor, non_blocking=gpu)
        if gpu:  # its memory is reused only after the copy
            tensor.record_stream(self.stream)
        return host

    def _unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        for wanted in (saved, *saved.before):  # this layer's input, then the next one backward needs
            if wanted.on_device is None:
                self._fetch(wanted)
        tensor = saved.on_device
        if saved.host is not None:  # the device copy lives as long as its consumer holds it
            saved.on_device = None
        if saved.ready is not None:
            stream = torch.cuda.current_stream(tensor.device)
            stream.wait_event(saved.ready)
            tensor.record_stream(stream)
            saved.ready = None
        if saved.dtensor is not None:
            mesh, placements, shape, stride = saved.dtensor
            tensor = DTensor.from_local(tensor, mesh, placements, run_check=False, shape=shape, stride=stride)
        return tensor

    def _fetch(self, saved: _Saved) -> None:
        """Start copying `saved` back to its device (at once on CPU)."""
        gpu = saved.device.type == "cuda"
        with self._on_side(gpu):
            saved.on_device = saved.host.to(saved.device, copy=True, non_blocking=gpu)
            saved.ready = self.stream.record_event() if gpu else None

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def _on_side(self, gpu: bool) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream) if gpu else contextlib.nullcontext()


def offload_layer_inputs(layers: Sequence[torch.nn.Module]) -> LayerInputOffload:
    """Keep the inputs that full activation checkpointing saves of `layers` (in forward order) in host
    memory, all but the last layer's; apply after the blocks are wrapped (and sharded)."""
    offload = LayerInputOffload()
    for i, block in enumerate(layers):
        block.register_forward_pre_hook(partial(offload.enter, i, i == len(layers) - 1))
        block.register_forward_hook(offload.exit, always_call=True)
    return offload


def layer_input_bytes(seq_len: int, cp: int, dim: int, dtype_bytes: int, local_batch: int = 1, tp: int = 1) -> int:
    """One layer's input on one rank, what its offload moves each way per step: (seq_len / cp) x dim
    activations per sequence, split over `tp` under sequence parallelism (TorchTitan's default with TP)."""
    return local_batch * (seq_len // cp // tp) * dim * dtype_bytes


def offload_bytes_per_rank(
    n_layers: int, seq_len: int, cp: int, dim: int, dtype_bytes: int, local_batch: int = 1, tp: int = 1
) -> int:
    """Host memory one rank's offload holds at the end of a forward: every layer's input but the last's."""
    return (n_layers - 1) * layer_input_bytes(seq_len, cp, dim, dtype_bytes, local_batch, tp)


def offload_seconds(nbytes: float, bandwidth: float = PCIE_GEN5_X16) -> float:
    """Time one copy of `nbytes` takes each way at `bandwidth` bytes/s (default PCIe Gen5 x16)."""
    return nbytes / bandwidth
