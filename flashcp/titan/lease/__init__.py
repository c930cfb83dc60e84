"""The TorchTitan parts of a GPU lease (`scripts/gpu_lease.sh`, `flashcp.gpucheck.lease` runs them):

- `jobs`: the jobs each part runs, at GPU sizes and at toy sizes for the CPU rehearsal;
- `train` (part b): the trainer through the launcher, variant by variant, with its checks and figures;
- `memory` (part c): the dry run's predicted peak of every job parts b and d train, beside the allocator's;
- `frontier` (part d): Llama 3 8B layer stacks at 128K tokens on one rank, per-layer and fixed terms;
- `results`: one part's JSON file, rewritten as each result arrives.

May import: torch, TorchTitan, the core, `flashcp.data`, `flashcp.run`, and `flashcp.titan.config`,
`flashcp.titan.dryrun` (the dry runs it compares against), `flashcp.titan.launch` (the launcher, run in
a forked child on a CPU); no other room imports it.
"""
