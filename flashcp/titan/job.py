"""A validated job (`flashcp.titan.config.load_job`) as TorchTitan's `Trainer.Config`.

Each section maps onto the TorchTitan dataclass of the same name; `[model]` picks the model
spec, `[data]` and `[flashcp]` configure the window loader and the attention, `[job]` the output
folder. Building the config loads the tokenizer (to size the vocabulary) but starts nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.config import TrainingConfig
from torchtitan.config.configs import CommConfig, CompileConfig, DebugConfig, ParallelismConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from flashcp.titan import compat
from flashcp.titan.checkpoint import Checkpointer
from flashcp.titan.components import PipelineTokenizer, resolve_tokenizer, WindowDataLoader
from flashcp.titan.hf_export import job_model_record
from flashcp.titan.heldout import held_out_data
from flashcp.titan.loss import loss_config
from flashcp.data.sources import DataConfig
from flashcp.titan.metrics import FlashCPMetrics
from flashcp.titan.model import model_spec
from flashcp.titan.trainer import FlashCPSettings, FlashCPTrainer
from flashcp.titan.validate import FlashCPValidator


SEED_DEGREES = ("data_parallel_replicate", "data_parallel_shard", "context_parallel", "tensor_parallel")


def trainer_config(cfg: dict[str, Any]) -> FlashCPTrainer.Config:
    """Map every section of a validated job onto the trainer's config."""
    data = DataConfig(**cfg["data"])
    tokenizer = resolve_tokenizer(data.tokenizer)
    flashcp_on = cfg["model"]["attention"] == "flashcp"
    train, par, fcp = cfg["training"], dict(cfg["parallelism"]), cfg["flashcp"]
    spec = model_spec(cfg["model"], fcp, tokenizer.vocab_size, train["seq_len"])
    if cfg["checkpoint"]["create_seed_checkpoint"]:  # one rank, no sharding
        par |= {f"{name}_degree": 1 for name in SEED_DEGREES}
    cp = par["context_parallel_degree"]
    # FlashCP's parallelize follows TorchTitan's "partial_dtensor" recipe (DTensor for TP only).
    spmd_backend = "partial_dtensor" if flashcp_on else compat.default_spmd_backend()
    windows: dict[str, Any] = {  # how windows are planned, training and held-out alike
        # TorchTitan's own CP shards windows itself: plan them trivially for one rank.
        "cp_size": cp if flashcp_on else 1,
        "planner": (
            {"strategy": fcp["strategy"], "target_imbalance": fcp["target_imbalance"]}
            if flashcp_on else {"strategy": "per_seq"}
        ),
    }
    return FlashCPTrainer.Config(
        model_spec=spec,
        dump_folder=cfg["job"]["dump_folder"],
        tokenizer=PipelineTokenizer.Config(path=data.tokenizer),
        dataloader=WindowDataLoader.Config(data=data, **windows),
        # Before the output projection a rank holds seq_len / cp tokens (TP replicates them there).
        loss=loss_config(spec.model.vocab_size, train["seq_len"] // cp, cfg["loss"]["chunk_tokens"]),
        optimizer=_optimizer(cfg["optimizer"]),
        lr_scheduler=LRSchedulersContainer.Config(**cfg["lr_scheduler"]),
        training=TrainingConfig(
            **{k: v for k, v in train.items() if k not in ("seed", "deterministic")},
            # Every window has a different plan, so shapes are not static across steps.
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(
            **{k: v for k, v in par.items() if k != "spmd_backend"},
            spmd_backend=par["spmd_backend"] or spmd_backend,
        ),
        checkpoint=Checkpointer.Config(
            **cfg["checkpoint"], initial_load_model_only=cfg["checkpoint"]["initial_load_path"] is not None,
            model_record=job_model_record(cfg, tokenizer.vocab_size, tokenizer.path),
        ),
        # Read by TorchTitan's state_dict_adapter only to shard its own HF saves, which FlashCP does not use
        # (flashcp.titan.hf_export writes them); its default would name a folder of TorchTitan's tests.
        hf_assets_path=None,
        metrics=FlashCPMetrics.Config(**cfg["metrics"]),
        activation_checkpoint=_activation_checkpoint(cfg["activation_checkpoint"]["mode"]),
        compile=CompileConfig(**cfg["compile"]),
        comm=CommConfig(**cfg["comm"]),
        debug=DebugConfig(seed=train["seed"], deterministic=train["deterministic"]),
        validator=_validator(cfg, windows),
        flashcp=FlashCPSettings(enable=flashcp_on, **fcp),
    )


def _validator(cfg: dict[str, Any], windows: dict[str, Any]) -> FlashCPValidator.Config:
    """`[validation]`: TorchTitan's validator fields as they are, the held-out data as a window loader."""
    names = {f.name for f in dataclasses.fields(FlashCPValidator.Config)}
    held_out = held_out_data(cfg)
    return FlashCPValidator.Config(
        **{k: v for k, v in cfg["validation"].items() if k in names},
        dataloader=WindowDataLoader.Config(data=held_out, **windows) if held_out else WindowDataLoader.Config(),
    )


def _optimizer(opt: dict[str, Any]) -> OptimizersContainer.Config:
    kwargs = {
        "lr": opt["lr"],
        "betas": (opt["beta1"], opt["beta2"]),
        "eps": opt["eps"],
        "weight_decay": opt["weight_decay"],
    }
    group = ParamGroupConfig(pattern=r".*", optimizer_name=opt["name"], optimizer_kwargs=kwargs)
    return OptimizersContainer.Config(param_groups=[group], implementation=opt["implementation"])


def _activation_checkpoint(mode: str) -> SelectiveAC.Config | FullAC.Config | None:
    return {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[mode]

