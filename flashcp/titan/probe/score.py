"""The probe scored through the trainer's own path: plan, dispatch, CP attention, in-document positions.

`Probe` builds the prompts and packs them into windows once (host work, the same on every rank),
keeps this data-parallel rank's share with their plans and dispatches, and at each probe step
runs them like held-out windows: the trainer's `window_inputs` / `flashcp_inputs` (the training
step's own functions), the model in eval mode without gradients, and the logits of one slice of
tokens at a time (`score_tokens`, as validation). For every answer token it adds the log-
probability of the right token and whether it was the argmax to its prompt's slot; the slots are
summed over the DP x CP ranks, so any layout gives the same figures. No generation: the answer
is teacher-forced, one forward pass per window.

Per (length, depth) cell: `logprob`, the mean log-probability of an answer token, and `accuracy`,
the fraction of prompts whose every answer token is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import numpy as np
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torchtitan.components.loss import compute_logprobs, IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils

from flashcp.data.errors import DataError
from flashcp.data.tokenizer import Tokenizer
from flashcp.plan import plan_shards
from flashcp.titan.components.validate import score_tokens, WindowPath
from flashcp.titan.probe.prompts import build_prompts, haystack_stream, pack, ProbeSettings


@dataclass
class ProbeResult:
    """One probe run, summed over every rank: the grid of scores by prompt length and needle depth."""

    step: int
    lengths: list[int]
    depths: list[float]
    logprob: np.ndarray  # [lengths, depths] mean log-probability of an answer token
    accuracy: np.ndarray  # [lengths, depths] fraction of prompts with every answer token the argmax
    tokens: int  # tokens run per probe (every window of every data-parallel rank)

    @property
    def mean_accuracy(self) -> float:
        return float(self.accuracy.mean())


class Probe:
    """The prompts of `settings`, packed, planned and dispatched for this rank; `run` scores them."""

    def __init__(
        self, settings: ProbeSettings, seq_len: int, tokenizer: Tokenizer, *, bos: bool, cp_size: int,
        planner: dict[str, Any], dispatch: Callable[[Any], Any], dp_rank: int = 0, dp_world: int = 1,
    ) -> None:  # fmt: skip
        if settings.haystack is None:
            raise DataError("[probe] needs [validation] source: the haystack is held-out text")
        self.settings, self.seq_len = settings, seq_len
        self.lengths = settings.grid_lengths(seq_len)
        stream = haystack_stream(settings.haystack, tokenizer, max(self.lengths))
        prompts = build_prompts(settings, seq_len, tokenizer, stream, tokenizer.bos_id if bos else None)
        windows = pack(prompts, seq_len, stream, dp_world)
        self.tokens = len(windows) * seq_len
        self.cells = np.array([p.cell for p in prompts]).reshape(-1, 2)
        self.answers = np.array([len(p.tokens) - p.answer for p in prompts])
        self.mine = []  # (window, its dispatch) of this DP rank
        for w in windows[dp_rank::dp_world]:
            plan = plan_shards(w.doc_lens, cp_size, **planner)
            self.mine.append((w, dispatch(plan)))

    @torch.no_grad()
    def run(self, path: WindowPath, model: nn.Module, loss_fn: Any, context: Callable[[], ContextManager],
            mesh: Any, step: int) -> ProbeResult:  # fmt: skip
        """Score every window on this rank; `mesh`: the DP x CP mesh the slots are summed over (None: one rank)."""
        slots = len(self.answers)
        tally = _AnswerSums(slots, path.device)
        model.eval()
        try:
            for w, dispatch in self.mine:
                batch = {"input": torch.from_numpy(w.input), "labels": torch.from_numpy(w.labels),
                         "doc_lens": w.doc_lens, "dispatch": dispatch}  # fmt: skip
                input_dict, labels = path.window_inputs(batch)
                slot = torch.from_numpy(w.slot)[dispatch.token_index][None].to(path.device)
                input_dict = {k: v.to(path.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
                inputs, labels, extra = path.flashcp_inputs(input_dict, labels.to(path.device))
                with context():
                    score_tokens(model, loss_fn, inputs, labels, extra, tally, slot=slot)
        finally:
            model.train()
        logp, wrong = tally.logp[:slots], tally.wrong[:slots].to(torch.float64)
        if mesh is not None:
            logp, wrong = dist_utils.dist_sum_tensor(logp, mesh), dist_utils.dist_sum_tensor(wrong, mesh)
        return self._cells(step, logp.cpu().numpy(), wrong.cpu().numpy())

    def _cells(self, step: int, logp: np.ndarray, wrong: np.ndarray) -> ProbeResult:
        shape = (len(self.lengths), len(self.settings.depths))
        lp_sum, answer_tokens, right, prompts = (np.zeros(shape) for _ in range(4))
        at = tuple(self.cells.T)
        np.add.at(lp_sum, at, logp)
        np.add.at(answer_tokens, at, self.answers)
        np.add.at(right, at, wrong == 0)
        np.add.at(prompts, at, 1)
        return ProbeResult(step, self.lengths, list(self.settings.depths), lp_sum / answer_tokens,
                           right / prompts, self.tokens)  # fmt: skip


class _AnswerSums:
    """Per prompt slot: the log-probability of each answer token and how many were not the argmax.

    Called like TorchTitan's inner loss (per slice inside `ChunkedLossWrapper`, which slices `slot`
    with the labels). Tokens outside any answer add into a spare last slot: no data-dependent shape."""

    def __init__(self, slots: int, device: torch.device) -> None:
        self.logp = torch.zeros(slots + 1, dtype=torch.float64, device=device)
        self.wrong = torch.zeros(slots + 1, dtype=torch.int64, device=device)

    def __call__(
        self, logits: torch.Tensor, labels: torch.Tensor, _global_valid_tokens: Any = None, *, slot: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if isinstance(logits, DTensor):  # vocabulary-split (TP): gathered as compute_logprobs does
            placements = tuple(Replicate() if isinstance(p, Shard) and p.dim in (-1, logits.ndim - 1) else p
                               for p in logits.placements)  # fmt: skip
            logits = logits.redistribute(placements=placements).to_local()
        logits = logits.float()
        logp = compute_logprobs(logits, labels)  # 0 at IGNORE_INDEX labels
        wrong = (labels != IGNORE_INDEX) & (logits.argmax(-1) != labels)
        ids = slot.flatten()
        self.logp.index_add_(0, ids, logp.flatten().to(torch.float64))
        self.wrong.index_add_(0, ids, wrong.flatten().to(torch.int64))
        return -logp.sum(), {}
