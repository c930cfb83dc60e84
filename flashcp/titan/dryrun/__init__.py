"""Will a job fit its GPUs? One rank of it built and stepped on fake tensors, on any machine.

- `cli`: `python -m flashcp.titan.dryrun` (`__main__`): arguments, exit codes, the one-line verdict;
- `run`: the job's rank 0 built and stepped on fake tensors;
- `fakes`: the world it steps in (the fake process group, the dry-run kernel, balanced expert routing,
  the offload's copies counted as host memory);
- `shape`: the model's shape, the rank's layout and the plan figures the estimate and report read off
  the built job;
- `mesh`: in mesh scope, the mesh's busiest rank measured;
- `linear`: a hybrid's Gated DeltaNet layers as stand-ins with the GPU kernel's footprint;
- `pipeline`: a pipelined job's memory per stage, one stage measured;
- `standin`: the shipped tokenizer, synthetic documents, no validation or load for the files a job
  names and this machine lacks;
- `hfload`: a Hugging Face import's load planned for that rank as the checkpointer plans it;
- `report`: what it found (the `--json` object, the table), the offload's modelled time, the levers;
- `memtrack`: that rank's peak memory by category (torch's FSDP2 tracker plus FlashCP's share), host
  memory apart;
- `estimate`: the same peak counted from the model's shape and the layout, to check the tracker.

May import: torch, TorchTitan, the core, `flashcp.data` and the other rooms of flashcp.titan (it
builds the job as `train.py` does); no other room imports it.
"""
