"""Validation on held-out data through FlashCP's own path, with the loss by position in the document.

TorchTitan's `Validator` (plugged through the trainer config's `validator` slot) decides when to
validate (`freq`, and step 1) and how many windows to read (`steps`, -1: the whole held-out set).
Its loop assumes its own data loader and one loss per batch; this subclass keeps its settings,
its TorchTitan-attention input path and its `validation_context`, and reads the held-out windows
the way training reads its own: the window loader plans each for the CP group and builds this
rank's dispatch, and the trainer's `window_inputs` / `flashcp_inputs` (the same functions the
training step uses) give the document mask, in-document positions and `CPStep`. The model runs
in eval mode without gradients, so training continues exactly as without validation.

A long-context model is judged by how its loss falls with the context it has seen, so besides
the mean loss every validation reports the loss by the token's position inside its document,
in log-spaced buckets [0, bucket_min), [bucket_min, 2 bucket_min), ... up to `seq_len`. One pass
per window gives both: the decoder once, then the output projection and each token's cross-entropy
(TorchTitan's `compute_logprobs`) once per slice of tokens -- with `[loss] chunk_tokens`, through
TorchTitan's own `ChunkedLossWrapper` (its lm_head, slices and FSDP unshard) with this per-token
loss inside -- summed per bucket by the token's bucket id. Projecting once per bucket instead
would cost 9 vocabulary projections per window at 128K with 1K buckets. Sums and token counts
are summed over the DP x CP ranks: the mean is every labelled token's cross-entropy over their
count, as TorchTitan's loss function gives it, and the buckets' token-weighted mean is the mean.

The held-out loader is built anew at each validation, so every validation reads the same windows
from the beginning of the held-out data and checkpoints hold no validation state.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn
from torchtitan.components.loss import ChunkedLossWrapper, compute_logprobs, IGNORE_INDEX
from torchtitan.components.validate import Validator
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger

from flashcp.data.errors import DataError
from flashcp.dispatch import Dispatch
from flashcp.plan import Plan
from flashcp.titan.components.data import WindowDataLoader


def bucket_edges(seq_len: int, bucket_min: int) -> list[int]:
    """[0, bucket_min, 2 bucket_min, 4 bucket_min, ..., seq_len]: buckets doubling up to the context."""
    edges, hi = [0], bucket_min
    while hi < seq_len:
        edges.append(hi)
        hi *= 2
    return [*edges, seq_len]


def size_name(tokens: int) -> str:
    for unit, suffix in ((1 << 20, "M"), (1 << 10, "K")):
        if tokens and tokens % unit == 0:
            return f"{tokens // unit}{suffix}"
    return str(tokens)


def bucket_name(lo: int, hi: int) -> str:
    """"0-1K", "64K-128K", "512K-1M" (plain numbers where an edge is no multiple of 1K)."""
    return f"{size_name(lo)}-{size_name(hi)}"


@dataclass
class ValidationResult:
    """One validation, summed over every rank: the mean loss and the loss by position bucket."""

    step: int
    loss: float  # TorchTitan's loss function over all held-out tokens / their count
    tokens: int  # labelled tokens (EOS and other -100 labels excluded)
    windows: int  # held-out windows per data-parallel rank
    edges: list[int]  # bucket b holds in-document positions [edges[b], edges[b + 1])
    sums: list[float] = field(default_factory=list)  # token-loss sum per bucket
    counts: list[int] = field(default_factory=list)  # labelled tokens per bucket

    def by_position(self) -> dict[str, float]:
        """Mean loss per non-empty bucket, by `bucket_name`."""
        return {
            bucket_name(lo, hi): s / n
            for lo, hi, s, n in zip(self.edges, self.edges[1:], self.sums, self.counts)
            if n
        }


class WindowPath(Protocol):
    """The trainer's steps from a loader window to this rank's model inputs (`FlashCPTrainer`)."""

    device: torch.device

    def dispatch_window(self, plan: Plan) -> Dispatch: ...

    def window_inputs(self, batch: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]: ...

    def flashcp_inputs(
        self, input_dict: dict[str, Any], labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]: ...


def score_tokens(
    model: nn.Module, loss_fn: Any, inputs: torch.Tensor, labels: torch.Tensor, extra: dict[str, Any],
    tally: Any, **per_token: torch.Tensor,
) -> None:
    """The model once on a rank's tokens, then `tally(logits, labels, **per_token)` per slice of tokens:
    with `[loss] chunk_tokens`, TorchTitan's `ChunkedLossWrapper` (its lm_head, slices and FSDP
    unshard) with `tally` as its inner loss, so one slice's logits live at once; else all at once.
    `per_token` tensors are sliced with the labels. Validation and the retrieval probe score this way."""
    pred = model(inputs, **extra)  # the hidden states when the loss is chunked, else the logits
    if isinstance(loss_fn, ChunkedLossWrapper):
        chunked = copy.copy(loss_fn)  # the same lm_head and slices, the loss inside replaced
        chunked.loss_fn = tally  # type: ignore[assignment]
        chunked(pred, labels, **per_token)
    else:
        tally(pred, labels, **per_token)


class FlashCPValidator(Validator):
    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        """TorchTitan's validator settings; the held-out data as FlashCP's window loader; the buckets."""

        dataloader: WindowDataLoader.Config = field(default_factory=WindowDataLoader.Config)
        bucket_min: int = 1024
        """Upper edge of the first position bucket; each next bucket doubles, up to seq_len."""

    config: Config

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.edges = bucket_edges(self.seq_len, config.bucket_min)
        self.path: WindowPath | None = None
        self.flashcp = False

    def connect(self, path: WindowPath, flashcp: bool) -> None:
        """Read held-out windows through `path`; with FlashCP attention, dispatch them for this CP rank."""
        self.path, self.flashcp = path, flashcp

    def post_dataloading_process(
        self, input_dict: dict[str, Any], labels: torch.Tensor, model_parts: list[nn.Module]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """FlashCP's path (the trainer's, dispatch order and `CPStep`), else TorchTitan's validator's."""
        assert self.path is not None
        device = self.path.device
        input_dict = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
        if self.flashcp:
            return self.path.flashcp_inputs(input_dict, labels.to(device))
        return super().post_dataloading_process(input_dict, labels.to(device), model_parts)

    @torch.no_grad()
    def validate(self, model_parts: list[nn.Module], step: int) -> None:
        if self.path is None:
            raise RuntimeError("FlashCPValidator.connect() was not called: validate with FlashCPTrainer")
        for model in model_parts:
            model.eval()
        loader = self.dl_config.build(
            dp_world_size=self.dp_world_size, dp_rank=self.dp_rank, tokenizer=self.tokenizer,
            seq_len=self.seq_len, local_batch_size=self.local_batch_size,
        )  # fmt: skip
        if self.flashcp:
            loader.loader.dispatch_with(self.path.dispatch_window)
        n = len(self.edges) - 1
        # [total, bucket sums...] and [total, bucket counts...], this rank's tokens
        sums = torch.zeros(n + 1, dtype=torch.float64, device=self.path.device)
        counts = torch.zeros(n + 1, dtype=torch.int64, device=self.path.device)
        windows = 0
        try:
            for batch in itertools.islice(loader, None if self.config.steps == -1 else self.config.steps):
                windows += 1
                sums_w, counts_w = self._window(model_parts[0], batch)
                sums += sums_w
                counts += counts_w
        finally:
            loader.close()
            for model in model_parts:
                model.train()
        if self.parallel_dims.dp_cp_enabled:
            mesh = self.parallel_dims.get_optional_mesh("loss")
            sums = dist_utils.dist_sum_tensor(sums, mesh)
            counts = dist_utils.dist_sum_tensor(counts, mesh)
        sums_l, counts_l = sums.tolist(), counts.tolist()
        if not counts_l[0]:
            raise DataError(
                f"the held-out data ({loader.loader.source_name}) gave no labelled tokens in windows of "
                f"seq_len = {self.seq_len} for {self.dp_world_size} data-parallel rank(s)"
            )
        result = ValidationResult(
            step=step, loss=sums_l[0] / counts_l[0], tokens=counts_l[0], windows=windows, edges=self.edges,
            sums=sums_l[1:], counts=counts_l[1:],
        )  # fmt: skip
        self.log(result)

    def _window(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's token-loss sums and label counts of one window: [all tokens, each bucket...]."""
        assert self.path is not None
        input_dict, labels = self.path.window_inputs(batch)
        inputs, labels, extra = self.post_dataloading_process(input_dict, labels, [model])
        inner_edges = torch.tensor(self.edges[1:-1], device=labels.device)
        tally = _BucketSums(len(self.edges) - 1, labels.device)
        bucket = torch.bucketize(extra["positions"], inner_edges, right=True)
        with self.validation_context():
            score_tokens(model, self.loss_fn, inputs, labels, extra, tally, bucket=bucket)
        return tally.sums, tally.counts

    def log(self, result: ValidationResult) -> None:
        """TensorBoard (`validation/loss`, `validation/loss_by_position/<lo>-<hi>`) and one log line."""
        by_position = result.by_position()
        metrics = {"validation/loss": result.loss}
        metrics |= {f"validation/loss_by_position/{name}": loss for name, loss in by_position.items()}
        self.metrics_processor.logger.log(metrics, result.step)
        buckets = "  ".join(f"{name}: {loss:.4f}" for name, loss in by_position.items())
        logger.info(
            f"validation step {result.step}: loss {result.loss:.5f} over {result.tokens:,} tokens "
            f"({result.windows} windows per DP rank); by position {buckets}"
        )


class _BucketSums:
    """Cross-entropy of each labelled token, added up in total and by position bucket.

    Called like TorchTitan's inner loss (per slice of tokens inside `ChunkedLossWrapper`, which
    slices `bucket` with the labels); returns the slice's loss sum as the cross-entropy would."""

    def __init__(self, buckets: int, device: torch.device) -> None:
        self.sums = torch.zeros(buckets + 1, dtype=torch.float64, device=device)  # [total, buckets...]
        self.counts = torch.zeros(buckets + 1, dtype=torch.int64, device=device)

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, _global_valid_tokens: Any = None, *,
        bucket: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # compute_logprobs gathers vocabulary-split (TP) logits and gives 0 for IGNORE_INDEX labels
        nll = -compute_logprobs(logits, labels)
        # masked with where, not by indexing: no data-dependent shape, so no wait on the device
        valid = (labels != IGNORE_INDEX).flatten()
        token_loss = torch.where(valid, nll.flatten(), 0.0).to(torch.float64)
        ids = bucket.flatten()
        self.sums[0] += token_loss.sum()
        self.sums[1:].index_add_(0, ids, token_loss)
        self.counts[0] += valid.sum()
        self.counts[1:].index_add_(0, ids, valid.to(torch.int64))
        return nll.sum(), {}
