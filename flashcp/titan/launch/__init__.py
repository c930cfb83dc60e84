"""The job's front end: a job file checked, its inputs opened, and its ranks started on this node.

- `node`: `python -m flashcp.titan.launch` (`__main__`): check the job, hold its folders, meet the
  other nodes, start `train.py` through torchrun;
- `preflight`: the checks that open files (tokenizer, data, HF folders, memory) before any rank starts;
- `job`: a validated job as TorchTitan's `Trainer.Config`, which `train.py` runs.

May import: torch, TorchTitan, `flashcp.data`, `flashcp.run`, and every other room of flashcp.titan
(it assembles them); only the dry run and the probe's CLI import it, to build a job as `train.py` does,
and the GPU lease's trainer part, to run the launcher in a forked child on a CPU.
"""
