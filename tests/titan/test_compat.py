"""TorchTitan's own varlen attention (model.attention = "varlen", the comparison path) on an H100 or
newer: FA3 / FA4 only when torch can activate them, else torch's built-in FlashAttention-2. The GPU
is simulated by monkeypatching TorchTitan's capability probe. And a run of one rank does not wait for
other ranks at its end."""

from __future__ import annotations

import sys
import time
import types

import flashcp.titan  # noqa: F401  (TorchTitan shims before TorchTitan is imported)
import pytest
import torchtitan.tools.utils as tt_utils
from torch.nn.attention import _registry, current_flash_attention_impl, restore_flash_attention_impl
from torchtitan.models.common.attention import VarlenAttention

from flashcp.titan import compat


@pytest.fixture
def gpu(monkeypatch):
    """`gpu((9, 0))` makes TorchTitan see a GPU of that capability; activations are undone after."""

    def set_capability(capability: tuple[int, int]) -> None:
        def has_cuda_capability(major: int, minor: int) -> bool:
            return capability >= (major, minor)

        monkeypatch.setattr(tt_utils, "has_cuda_capability", has_cuda_capability)

    compat._activates.cache_clear()
    yield set_capability
    restore_flash_attention_impl(_raise_warn=False)
    compat._activates.cache_clear()
    sys.modules.pop("flash_attn_interface", None)


def _build_layers(n: int = 2) -> None:
    for _ in range(n):  # one VarlenAttention per transformer layer
        VarlenAttention(VarlenAttention.Config())


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)])
def test_varlen_attention_builds_without_fa3_or_fa4(gpu, capability):
    """Neither flash_attn_interface (FA3) nor flash_attn.cute (FA4) is installed here: activating
    them raised ModuleNotFoundError at model construction; now FA2 is left in place."""
    gpu(capability)
    _build_layers()
    assert current_flash_attention_impl() is None


def test_an_fa3_module_without_its_kernels_is_not_taken(gpu, tmp_path, monkeypatch):
    """A `flash_attn_interface` that imports but registers no torch.ops.flash_attn_3 kernels (an
    incompatible build) would pass an import check and still fail activation."""
    (tmp_path / "flash_attn_interface.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    gpu((9, 0))
    _build_layers()
    assert current_flash_attention_impl() is None


def test_an_implementation_torch_accepts_is_used_and_activated_once(gpu, monkeypatch):
    class Handle:
        def remove(self) -> None:
            pass

    activations = []

    def register() -> Handle:
        activations.append("FA3")
        return Handle()

    monkeypatch.setitem(_registry._FLASH_ATTENTION_IMPLS, "FA3", register)
    gpu((9, 0))
    _build_layers(3)
    assert current_flash_attention_impl() == "FA3"
    assert activations == ["FA3"]


def test_one_rank_skips_the_wait_for_other_ranks_and_more_ranks_keep_it(monkeypatch):
    """TorchTitan's `Trainer.train` ends with `time.sleep(2)` on rank 0 (its module's only sleep)."""
    import torch.distributed as dist
    import torchtitan.trainer as titan_trainer

    slept: list[float] = []
    monkeypatch.setattr(titan_trainer, "time", types.SimpleNamespace(sleep=slept.append, monotonic=time.monotonic))
    with compat.no_final_wait_alone():
        titan_trainer.time.sleep(2)
        assert titan_trainer.time.monotonic is time.monotonic  # the rest of the module is the same
    titan_trainer.time.sleep(2)
    assert slept == [2]  # only outside
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    with compat.no_final_wait_alone():
        titan_trainer.time.sleep(2)
    assert slept == [2, 2]


def test_fsdp_group_shims_read_torch_2_11s_one_group_and_2_13s_list():
    """torch 2.11's FSDPState holds one `_fsdp_param_group` (no list, no property): the dry run's
    tracker must find no extra groups and leave the class alone; torch 2.13's list gives the rest."""
    from types import SimpleNamespace

    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    from flashcp.titan.compat import extra_fsdp_param_groups, fsdp_one_group_property

    assert extra_fsdp_param_groups(SimpleNamespace(_fsdp_param_group="g0")) == []
    assert extra_fsdp_param_groups(SimpleNamespace(_fsdp_param_groups=["g0", "g1", "g2"])) == ["g1", "g2"]
    found = fsdp_one_group_property()
    assert found is FSDPState.__dict__.get("_fsdp_param_group") or (found is None and not hasattr(FSDPState, "_fsdp_param_groups"))
