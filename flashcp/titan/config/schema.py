"""Every key a job file may set: `SCHEMA`, section -> key -> `Key`.

TorchTitan's sections come from its config classes (`flashcp.titan.config.titan`); FlashCP's own
are declared here: `[job]`, `[model]` (the Llama 3 spec), `[data]` (the data pipeline's
`DataConfig`, field for field), `[loss]`, `[flashcp]` and `[validation]` (TorchTitan's validator
settings with FlashCP's held-out data) and `[probe]` (the retrieval probe). `python -m flashcp.titan.config --keys`
lists them all with their defaults.
"""

from __future__ import annotations

import dataclasses
import typing

from flashcp.attention.kernels import BACKENDS as KERNELS
from flashcp.attention.two_level import EXCHANGES
from flashcp.costmodel.model import WINDOW_COMMS
from flashcp.data.sources import DataConfig
from flashcp.plan import STRATEGIES
from flashcp.titan.config.converters import CONVERTER_KEYS
from flashcp.titan.config.keys import field_default, Key, key_from_hint
from flashcp.titan.config.model import MODEL_KEYS
from flashcp.titan.config.scope import MESH_MIN_SEQ_LEN
from flashcp.titan.config.titan import class_keys, TITAN_KEYS

BACKENDS = ("auto", *KERNELS)
SCOPES = ("auto", "group", "mesh")  # [flashcp] scope: what one FlashCP plan covers
RANKS_PER_NODE_COMMS = ("two_level",)  # [flashcp] comm modes whose exchange reads [flashcp] ranks_per_node
GPU_BACKENDS = tuple(name for name in KERNELS if name != "reference")


def _data_keys() -> dict[str, Key]:
    """`[data]` is the data pipeline's `DataConfig`, key for key."""
    hints = typing.get_type_hints(DataConfig)
    return {f.name: key_from_hint(hints[f.name], field_default(f), f"[data] {f.name}")
            for f in dataclasses.fields(DataConfig)}  # fmt: skip


def _validation_keys() -> dict[str, Key]:
    """`[validation]`: TorchTitan's validator settings with its types and defaults (`Validator.Config`;
    its data loader is FlashCP's, `flashcp.titan.components.validate`), then the held-out data and the buckets."""
    from torchtitan.components.validate import Validator  # after flashcp.titan's shims (package import)

    return class_keys(Validator.Config, "validation") | {
        "source": Key(str, doc='held-out data, as [data] source (a token store, files, "synthetic"); "default": '
                      "the shipped corpus's held-out split, data/default/valid.jsonl.gz"),
        "hf_split": Key(str, "validation", doc='the split a "hf:NAME" source reads'),
        "bucket_min": Key(int, 1024, doc="loss by position in the document: buckets [0, bucket_min), then "
                          "doubling up to seq_len"),
    }


OWN_SECTIONS: dict[str, dict[str, Key]] = {
    "job": {
        "description": Key(str, ""),
        # TorchTitan's Trainer.Config.dump_folder (tests/titan/test_config.py checks the default).
        "dump_folder": Key(str, "./outputs", doc="logs, TensorBoard files and checkpoints go here"),
    },
    "model": MODEL_KEYS,
    "data": _data_keys(),
    "loss": {
        "chunk_tokens": Key(int, 2048, doc="cross-entropy over at most this many tokens at a time "
                            "(flashcp.titan.components.loss); 0: all of a rank's tokens at once"),
    },
    "flashcp": {
        "strategy": Key(str, "flashcp", tuple(STRATEGIES), "how each window is sharded over the CP ranks"),
        "scope": Key(str, "auto", SCOPES, "group: each DP group plans its own window of seq_len tokens over its CP "
                     "ranks | mesh: the step's global batch (DP x seq_len tokens) is one window planned over all "
                     "DP x CP ranks (flashcp.plan.mesh, flashcp.titan.mesh_scope); needs strategy flashcp, comm "
                     "compact | needed | two_level, data.balance = 'off' | auto: mesh (and data.balance 'off') when "
                     f"DP > 1, seq_len >= {MESH_MIN_SEQ_LEN} and the job sets no [data] balance key nor anything the "
                     "mesh scope refuses, else group; the start logs which and why (modelled step, docs/training.md "
                     "\"Default scope\")"),
        "target_imbalance": Key(float, 1.05, doc="max / mean attention workload the planner aims for"),
        "comm": Key(str, "compact", EXCHANGES, "KV exchange: compact (FlashCP) | full (Llama3 CP) | needed "
                    "(each rank exactly the rows it attends to) | two_level (the needed rows of a CP group that "
                    "spans nodes: over the fabric once per node, then NVLink; on one node the same as needed) | ring "
                    "(KV blocks passed around the ranks, one kernel call per step: Ring-Attn with strategy "
                    "ring, Ring-Attn (Zigzag) with per_doc; kernels torch or reference)"),
        "ranks_per_node": Key(int, 0, doc="two_level or scope = 'mesh' only: the CP group's (mesh scope: the "
                              "DP x CP mesh's) ranks per node; 0: from the launch (LOCAL_WORLD_SIZE and the mesh). "
                              "Set, it simulates nodes (tests) and must divide context_parallel_degree (mesh "
                              "scope: DP x CP)"),
        "window_comm": Key(str, "auto", WINDOW_COMMS, "sliding-window layers' (gpt-oss) KV exchange; auto: needed "
                           "(the W - 1 rows before each cut, all-to-all-v), two_level with comm = 'two_level'; "
                           "compact | full | needed | two_level (needs comm = 'two_level') as given"),
        "backend": Key(str, "auto", BACKENDS, "varlen kernel; auto: flash_attn, torch, then reference"),
        "overlap": Key(bool, False, doc="compute all-local shards while the KV exchange is in flight"),
        "plan_worker": Key(bool, True, doc="with CP > 1, plan and dispatch each window in a child process, "
                           "off the training thread's GIL (flashcp.data.plan_worker)"),
        "plan_worker_timeout_seconds": Key(float, 0.0, doc="a planning worker that has not answered for this "
                                           "long stops the run naming it (a stopped one at once); below [comm] "
                                           "train_timeout_seconds; 0: half of that"),
    },

    # TorchTitan's `validator` section, named as the job files name it.
    "validation": _validation_keys(),
    "probe": {
        "enable": Key(bool, False, doc="score a retrieval probe through the CP path during training "
                      "(flashcp.titan.probe, docs/probe.md); its tokens per run are printed"),
        "freq": Key(int, 100, doc="probe every freq steps (and at step 1)"),
        "lengths": Key(list[int], [], doc="prompt lengths in tokens; []: doubling from min_length up to seq_len"),
        "min_length": Key(int, 4096, doc="the shortest prompt when lengths = [] (seq_len if longer)"),
        "depths": Key(list[float], [0.0, 0.25, 0.5, 0.75, 1.0], doc="where the needle sits in the haystack, "
                      "0 (start) to 1 (end)"),
        "samples": Key(int, 4, doc="prompts per (length, depth) cell, each with its own key and haystack"),
        "seed": Key(int, 0, doc="keys and haystack offsets: the same prompts on every rank and run"),
        "key_digits": Key(int, 5, doc="digits of the number hidden and asked for"),
    },
    # TorchTitan's converter configs ([model] converters), field for field.
    **CONVERTER_KEYS,
}
ORDER = ("job", "model", "data", "training", "optimizer", "lr_scheduler", "parallelism", "checkpoint",
         "metrics", "activation_checkpoint", "compile", "comm", "profiler", "debug", "loss", "flashcp",
         "validation", "probe", "float8", "mx")  # fmt: skip
SCHEMA: dict[str, dict[str, Key]] = {name: (OWN_SECTIONS | TITAN_KEYS)[name] for name in ORDER}
# Sections TorchTitan names otherwise: an unknown-section error names FlashCP's.
RENAMED_SECTIONS = {"validator": "validation"}
