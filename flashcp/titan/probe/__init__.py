"""A retrieval probe by needle depth and prompt length, scored through FlashCP's CP path.

A number hidden at a depth of real held-out text and asked for at the end, scored by the model's
log-probability of the answer tokens and whether each is the argmax (teacher-forced, one forward
pass, no generation), per (length, depth) cell; several prompts packed per window as separate
documents. Modules: `prompts` (settings, prompts, packing), `score` (the run through the trainer's
path), `report` (heatmap, table, TensorBoard), `loop` (inside training), `cli`
(`python -m flashcp.titan.probe` on a checkpoint or an exported Hugging Face folder). docs/probe.md.

May import: torch, TorchTitan, numpy, matplotlib, `compat`, `trainer`, and the rooms `components`
(the held-out data, validation's token scoring), `config` and `launch` (the CLI builds a job as
train.py does) and `hf` (the CLI checks a checkpoint as the export does).
"""

from flashcp.titan.probe.prompts import ProbeSettings
from flashcp.titan.probe.score import Probe, ProbeResult

__all__ = ["Probe", "ProbeResult", "ProbeSettings"]
