"""A validated job (`flashcp.titan.config.load_job`) as TorchTitan's `Trainer.Config`.

TorchTitan's sections become its config classes (`flashcp.titan.config.titan.titan_configs`);
`[model]` picks the model spec, `[data]` and `[flashcp]` configure the window loader and the
attention, `[validation]` the held-out loader, `[probe]` the retrieval probe, `[job]` the output folder. Building the config
loads the tokenizer (to size the vocabulary) but starts nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flashcp.titan.components.data import PipelineTokenizer, resolve_tokenizer, WindowDataLoader
from flashcp.titan.config.converters import converter_configs, model_compiled
from flashcp.titan.config.titan import titan_configs
from flashcp.titan.hf.export import job_model_record
from flashcp.titan.components.heldout import held_out_data
from flashcp.titan.components.loss import loss_config
from flashcp.data.sources import DataConfig
from flashcp.titan.models.spec import model_spec
from flashcp.titan.models.windows import planner_workload
from flashcp.titan.probe.prompts import ProbeSettings
from flashcp.titan.trainer import FlashCPSettings, FlashCPTrainer
from flashcp.titan.components.validate import FlashCPValidator


def trainer_config(cfg: dict[str, Any]) -> FlashCPTrainer.Config:
    """Map every section of a validated job onto the trainer's config."""
    data = DataConfig(**cfg["data"])
    tokenizer = resolve_tokenizer(data.tokenizer)
    flashcp_on = cfg["model"]["attention"] == "flashcp"
    train, fcp = cfg["training"], cfg["flashcp"]
    spec = model_spec(cfg["model"], fcp, tokenizer.vocab_size, train["seq_len"],
                      offload=cfg["activation_checkpoint"]["offload"],
                      mlp_tiles=cfg["activation_checkpoint"]["mlp_tiles"],
                      head_groups=cfg["activation_checkpoint"]["head_groups"],
                      head_group_prefetch=cfg["activation_checkpoint"]["head_group_prefetch"],
                      converters=converter_configs(cfg),
                      compiled=model_compiled(cfg))  # fmt: skip
    sections = titan_configs(cfg)  # training, optimizer, parallelism, checkpoint, ... (TorchTitan's classes)
    sections["checkpoint"].model_record = job_model_record(cfg, tokenizer.vocab_size, tokenizer.path)
    cp = sections["parallelism"].context_parallel_degree
    windows: dict[str, Any] = {  # how windows are planned, training and held-out alike
        # TorchTitan's own CP shards windows itself: plan them trivially for one rank.
        "cp_size": cp if flashcp_on else 1,
        "planner": (
            {"strategy": fcp["strategy"], "target_imbalance": fcp["target_imbalance"],
             "workload": planner_workload(spec.model)}
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
        # Read by TorchTitan's state_dict_adapter only to shard its own HF saves, which FlashCP does not use
        # (flashcp.titan.hf.export writes them); its default would name a folder of TorchTitan's tests.
        hf_assets_path=None,
        validator=_validator(cfg, windows),
        flashcp=FlashCPSettings(enable=flashcp_on, **fcp),
        probe=ProbeSettings(**cfg["probe"], haystack=held_out_data(cfg)),
        **sections,
    )


def _validator(cfg: dict[str, Any], windows: dict[str, Any]) -> FlashCPValidator.Config:
    """`[validation]`: TorchTitan's validator fields as they are, the held-out data as a window loader."""
    names = {f.name for f in dataclasses.fields(FlashCPValidator.Config)}
    held_out = held_out_data(cfg)
    return FlashCPValidator.Config(
        **{k: v for k, v in cfg["validation"].items() if k in names},
        dataloader=WindowDataLoader.Config(data=held_out, **windows) if held_out else WindowDataLoader.Config(),
    )
