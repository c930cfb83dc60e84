"""`[activation_checkpoint] offload`: full AC's saved layer inputs in host memory.

The offloader on CPU (the same path as on a GPU, copying synchronously): the inputs checkpoint
saves leave the blocks' saved state, come back equal, and unpacking layer i's starts layer
i-1's copy. Through the trainer: CP 2 x FSDP 2 (Llama 3 and Qwen3) and TP 2 x CP 2 train the
same losses and gradient norms with and without offload, and an offloaded run resumes exactly.
The modelled traffic of Llama 3 8B at 1M tokens on CP 8.
"""

from __future__ import annotations

import os
import weakref
from unittest.mock import patch

import pytest
import torch
from harness import TINY, tiny_job, train
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from flashcp.titan.models.offload import layer_input_bytes, LayerInputOffload, offload_bytes_per_rank
from flashcp.titan.models.offload import offload_layer_inputs, offload_seconds

STEPS = 5
QWEN3 = {"name": "qwen3", "head_dim": 16}  # QK-norm, a head_dim other than dim / heads
LAYOUTS = {  # on 4 ranks
    "llama3 CP 2 x FSDP 2": ({}, {"context_parallel_degree": 2, "data_parallel_shard_degree": 2}),
    "qwen3 CP 2 x FSDP 2": (QWEN3, {"context_parallel_degree": 2, "data_parallel_shard_degree": 2}),
    "llama3 TP 2 x CP 2": ({}, {"context_parallel_degree": 2, "tensor_parallel_degree": 2}),
}


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
    compute alone (2 x 218M parameters x 131072 tokens = 57 TFLOP: 58 ms at H100's 989 TFLOP/s peak)."""
    per_layer = layer_input_bytes(1 << 20, 8, 4096, 2)
    assert per_layer == 2**30 and layer_input_bytes(1 << 20, 8, 4096, 2, local_batch=2, tp=2) == per_layer
    assert offload_bytes_per_rank(32, 1 << 20, 8, 4096, 2) == 31 * per_layer
    assert offload_seconds(per_layer) == pytest.approx(0.0215, rel=1e-2)
    assert offload_seconds(per_layer, bandwidth=25e9) == pytest.approx(2 * offload_seconds(per_layer))


def train_offloaded(rank: int, group, cfg: dict, stop_after: int | None = None):
    """DistributedPool task: a rank's losses, gradient norms and how many layer inputs went to host."""
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(group.size())})
    norms: dict[int, float] = {}
    to_host = LayerInputOffload._to_host
    copies = []
    with patch.object(LayerInputOffload, "_to_host", lambda self, t: copies.append(t.shape) or to_host(self, t)):
        losses = train(cfg, stop_after=stop_after, grad_norms=norms)
    return losses, norms, len(copies)


@pytest.mark.slow
def test_offload_trains_what_full_ac_trains_and_resumes_exactly(tmp_path, gloo_pool):
    """Offload only moves bytes: the same losses and gradient norms as full AC without it, bit for bit."""
    def job(name: str, model: dict, layout: dict, offload: bool, **sections) -> dict:
        return tiny_job(tmp_path / name, model=model, parallelism=layout, training={"steps": STEPS},
                        activation_checkpoint={"mode": "full", "offload": offload}, **sections)  # fmt: skip

    offloaded_layers = TINY["model"]["n_layers"] - 1
    runs = {}
    pool = gloo_pool(4)
    for name, (model, layout) in LAYOUTS.items():
        kept, kept_norms, none = pool.run(train_offloaded, (job(f"{name}/kept", model, layout, False),))[0]
        moved, moved_norms, copies = pool.run(train_offloaded, (job(f"{name}/moved", model, layout, True),))[0]
        print(f"{name}: offload {copies} layer inputs to host, losses {moved}, vs none {kept}")
        assert none == 0 and copies == STEPS * offloaded_layers
        assert sorted(moved) == list(range(1, STEPS + 1)) and moved[STEPS] < moved[1]  # it trains
        assert moved == kept and moved_norms == kept_norms
        runs[name] = moved
    # Stopped after step 3 and resumed: the last steps of the run straight through.
    model, layout = LAYOUTS["llama3 CP 2 x FSDP 2"]
    resumed = job("resumed", model, layout, True, checkpoint={"enable": True, "interval": 3})
    first = pool.run(train_offloaded, (resumed, 3))[0][0]
    rest = pool.run(train_offloaded, (resumed,))[0][0]
    straight = runs["llama3 CP 2 x FSDP 2"]
    assert first == {s: straight[s] for s in (1, 2, 3)} and rest == {s: straight[s] for s in (4, 5)}


def test_launcher_refuses_an_offload_the_node_cannot_hold(tmp_path, monkeypatch):
    """Llama 3 8B's dims at 1M tokens on CP 8 in bf16 pin 31 GiB per rank: 2 ranks fit a 64 GiB node, 8 do not."""
    from flashcp.titan.config import ConfigError
    from flashcp.titan.launch.preflight import check_offload_memory

    cfg = tiny_job(tmp_path, model={"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8},
                   training={"seq_len": 1 << 20, "mixed_precision_param": "bfloat16"},
                   parallelism={"context_parallel_degree": 8}, activation_checkpoint={"mode": "full", "offload": True})  # fmt: skip
    monkeypatch.setattr(os, "sysconf", {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 16 << 20}.get)  # 64 GiB
    check_offload_memory(cfg, 2)
    with pytest.raises(ConfigError, match=r"the offloads keep 31.0 GiB of host memory per rank \(\[activation_checkpoint\] "
                                          r"offload = true: 31 layer inputs\), 248 GiB for this node's 8 ranks, "
                                          r"which has 64 GiB"):  # fmt: skip
        check_offload_memory(cfg, 8)
    check_offload_memory(cfg | {"activation_checkpoint": {**cfg["activation_checkpoint"], "offload": False}}, 8)
