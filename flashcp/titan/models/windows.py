"""Per-layer dispatches: a sliding-window model's (one for its full-attention layers, one per window)
and a hybrid model's (the full layers' and its Gated DeltaNet layers' linear dispatch).

gpt-oss alternates layers whose queries see their last W keys with full ones. Both kinds run on
the same plan and the same rows; a window layer's exchange is smaller (`build_dispatch(...,
window=W)`: at most W - 1 rows before each shard), and runs its own exchange (`[flashcp]
window_comm`, `flashcp.costmodel.model.window_exchange`: by default the needed all-to-all-v, since a
compact all-gather pads every rank to the busiest sender). The trainer builds them together wherever it
builds a window's dispatch (the loader's thread or its plan worker, whose process imports this
module to unpickle the builder: so it imports torch and the engine only, not TorchTitan) and
moves them as one (`to`, `pin_memory`); `CPStep.of` hands each layer its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from flashcp.attention.linear_dispatch import build_linear_dispatch, LinearDispatch
from flashcp.dispatch import _map_tensors, Dispatch
from flashcp.plan.linear import LinearLayers
from flashcp.plan.plan import CAUSAL, Plan, row_bytes, Workload


class _FullRows:
    """Per-layer dispatches of one window run the same rows in the same order: the full layers'."""

    full: Dispatch

    @property
    def token_index(self) -> torch.Tensor:
        return self.full.token_index

    @property
    def positions(self) -> torch.Tensor:
        return self.full.positions


@dataclass(frozen=True)
class LayerDispatches(_FullRows):
    """A window's dispatch for the full-attention layers and one per sliding window; built and moved
    like one `Dispatch`."""

    full: Dispatch
    windows: dict[int, Dispatch]  # sliding window W -> build_dispatch(plan, ..., window=W)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> LayerDispatches:
        return LayerDispatches(self.full.to(device, non_blocking),
                               {w: d.to(device, non_blocking) for w, d in self.windows.items()})  # fmt: skip

    def pin_memory(self) -> LayerDispatches:
        return LayerDispatches(self.full.pin_memory(), {w: d.pin_memory() for w, d in self.windows.items()})


def build_layer_dispatches(plan: Plan, build: Callable[..., Dispatch], windows: tuple[int, ...],
                           build_window: Callable[..., Dispatch] | None = None) -> LayerDispatches:  # fmt: skip
    """`build(plan)` for the full layers and `build_window(plan, window=W)` (default `build`: the same
    exchange) for each window; picklable with functools.partial, for the loader's dispatch worker."""
    build_window = build if build_window is None else build_window
    return LayerDispatches(build(plan), {w: build_window(plan, window=w) for w in windows})


@dataclass(frozen=True)
class HybridDispatches(_FullRows):
    """A hybrid window's dispatches (Qwen3.5): the full layers' and the Gated DeltaNet layers'; built
    and moved like one `Dispatch`."""

    full: Dispatch
    linear: LinearDispatch

    def to(self, device: torch.device | str, non_blocking: bool = True) -> HybridDispatches:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> HybridDispatches:
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> HybridDispatches:
        """`fn` on every tensor, the linear fold's (M rows, B rows) pairs included."""
        return HybridDispatches(_map_tensors(self.full, fn), self.linear.map(fn))


def build_hybrid_dispatches(plan: Plan, build: Callable[[Plan], Dispatch], rank: int, conv_width: int
                            ) -> HybridDispatches:  # fmt: skip
    """`build(plan)` for the full layers and this rank's linear dispatch (picklable with
    functools.partial, for the loader's dispatch worker)."""
    return HybridDispatches(build(plan), build_linear_dispatch(plan, rank, conv_width))


def attention_layers(model_config) -> list:
    """The layers that attend (query, key) pairs: all but a hybrid model's Gated DeltaNet layers (a
    `delta_net`, no attention), whose cost is linear in the tokens and counted per token (`HybridDecoder`)."""
    return [layer for layer in model_config.layers if getattr(layer, "delta_net", None) is None]


def planner_workload(model_config) -> Workload:
    """What the planner balances for a TorchTitan decoder config with FlashCP attention: causal pairs
    (`CAUSAL`) when every layer is full, else the attention layers' kinds counted apart (gpt-oss: 12 full
    and 12 window of 24 with W = 128; Qwen3.5: its full layers' pairs and its Gated DeltaNet layers'
    `LinearLayers`, linear in tokens plus what cut documents add), so a rank of long documents is not
    charged window or Gated DeltaNet layers as full ones. The metrics take the same counts for the pairs
    the model attends (`attention_pairs`)."""
    layers = attention_layers(model_config)
    windows = [_window(layer) for layer in layers]
    sizes = {w for w in windows if w}
    if not sizes:
        if len(layers) == len(model_config.layers):
            return CAUSAL
        return Workload(full_layers=len(layers), linear=linear_layers(model_config))
    if len(sizes) > 1:  # one Workload holds one window; the planner then balances the smallest exactly
        raise ValueError(f"the planner balances one sliding window per model, this one has {sorted(sizes)}")
    return Workload(full_layers=windows.count(None), window_layers=len(windows) - windows.count(None),
                    window=sizes.pop())  # fmt: skip


def linear_layers(model_config) -> LinearLayers:
    """A hybrid decoder's Gated DeltaNet layers as the planner prices them, beside its full layers' K/V
    rows in bf16 (what a cut's state bytes are weighed against; `flashcp.plan.linear.LinearLayers`)."""
    linear = [layer.delta_net for layer in model_config.layers if getattr(layer, "delta_net", None) is not None]
    net, attention = linear[0], model_config.first_attention
    full = len(model_config.layers) - len(linear)
    return LinearLayers(
        layers=len(linear), heads=net.in_proj_v.out_features // net.value_head_dim, key_dim=net.key_head_dim,
        value_dim=net.value_head_dim, pair_flops=4 * attention.n_heads * attention.head_dim,
        kv_row_bytes=row_bytes(attention.n_kv_heads or attention.n_heads, attention.head_dim), full_layers=full,
        conv_channels=2 * net.in_proj_q.out_features + net.in_proj_v.out_features, conv_width=net.conv_kernel_size,
    )  # fmt: skip


def _window(layer) -> int | None:
    """An attention layer's sliding window; None for full attention."""
    return getattr(getattr(getattr(layer, "attention", None), "inner_attention", None), "window", None)
