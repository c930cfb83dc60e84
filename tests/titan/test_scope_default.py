"""`[flashcp] scope = "auto"` (the default): mesh when DP > 1 and seq_len >= MESH_MIN_SEQ_LEN, else group.

The rule is `flashcp.titan.config.scope.resolve_scope` on a validated job (no world size needed beyond the
degrees passed): what the job sets explicitly, a scope or a balance key, is kept."""

from __future__ import annotations

from typing import Any

import pytest

from flashcp.titan.config import validate
from flashcp.titan.config.scope import MESH_MIN_SEQ_LEN, resolve_scope

LONG = {"training": {"seq_len": MESH_MIN_SEQ_LEN}, "validation": {"enable": False}}


def _resolved(dp: int, **sections: Any) -> tuple[dict, str]:
    cfg = validate({**LONG, **sections})
    return cfg, resolve_scope(cfg, dp, 8)


def test_auto_is_the_mesh_scope_with_balance_off_from_dp_2_and_the_threshold():
    cfg, line = _resolved(2)
    assert (cfg["flashcp"]["scope"], cfg["data"]["balance"]) == ("mesh", "off")
    assert line.startswith("[flashcp] scope = 'mesh' (auto, DP = 2 > 1 and seq_len 1048576 >= 1048576")
    assert resolve_scope(cfg, 2, 8) == line  # checked again (launcher, then each rank): the same line


@pytest.mark.parametrize("dp, sections, why", [
    (1, {}, "auto, DP = 1: one group"),
    (8, {"training": {"seq_len": MESH_MIN_SEQ_LEN // 2}}, "auto, seq_len 524288 < 1048576"),
    (8, {"data": {"max_delay_steps": 8}}, "auto, [data] max_delay_steps is set"),
    (8, {"validation": {"enable": True, "source": "default"}}, "auto, [validation] enable = true"),
    (8, {"flashcp": {"strategy": "per_doc"}}, "auto, [flashcp] strategy = 'per_doc'"),
])  # fmt: skip
def test_auto_stays_per_group_with_the_loaders_balance(dp, sections, why):
    cfg, line = _resolved(dp, **sections)
    assert (cfg["flashcp"]["scope"], cfg["data"]["balance"]) == ("group", "deferral-cut")
    assert line.startswith(f"[flashcp] scope = 'group' ({why}")


def test_an_explicit_scope_or_balance_is_kept():
    cfg, line = _resolved(8, flashcp={"scope": "group"})
    assert (cfg["flashcp"]["scope"], cfg["data"]["balance"], line) == ("group", "deferral-cut",
                                                                       "[flashcp] scope = 'group' (set in the job)")
    cfg, line = _resolved(1, flashcp={"scope": "mesh", "comm": "needed"}, data={"balance": "off"})
    assert (cfg["flashcp"]["scope"], line) == ("mesh", "[flashcp] scope = 'mesh' (set in the job)")
    cfg, _ = _resolved(8, data={"balance": "deferral"})
    assert (cfg["flashcp"]["scope"], cfg["data"]["balance"]) == ("group", "deferral")


def test_ranks_per_node_under_auto_is_refused_where_auto_becomes_per_group(tmp_path):
    """With auto the config check cannot know whether `ranks_per_node` takes effect (it does in mesh
    scope): the layout check refuses it once auto became per-group with a comm that ignores it, and keeps
    it where auto became the mesh scope."""
    from flashcp.titan.config import ConfigError, check_layout

    short = validate({"training": {"seq_len": 4096}, "flashcp": {"comm": "needed", "ranks_per_node": 4},
                      "parallelism": {"context_parallel_degree": 4}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"^\[flashcp\] ranks_per_node = 4 has no effect with comm = 'needed' and "
                                          r"\[flashcp\] scope = 'group' \(auto, seq_len 4096 < 1048576"):
        check_layout(short, 8, has_cuda=False)
    long = validate({**LONG, "flashcp": {"comm": "needed", "ranks_per_node": 4},
                     "parallelism": {"context_parallel_degree": 4}})  # fmt: skip
    check_layout(long, 8, has_cuda=False)
    assert long["flashcp"]["scope"] == "mesh"
