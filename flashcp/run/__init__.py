"""What protects a user's run, independent of the trainer that runs in it.

- `launch`: torchrun's agent in the launcher process: ranks per node, rendezvous arguments,
  signal forwarding, the failing rank's one-line reason;
- `rank`: the rank's half of that contract (die with the launcher, room to report, the reason);
- `ownership`: one run per output folder (a kernel-dropped lock naming its holder), writable
  folders and free space checked before launch;
- `rendezvous`: the launchers of a multi-node job agree on the job (identity, settings, code, a
  shared folder) before any rank starts;
- `preemption`: SIGTERM / Ctrl-C stop every rank after the same step, with a checkpoint;
- `publish` and `manifest`: a checkpoint folder is published whole by a rename, with each file's
  size and CRC-32, and verified before it is loaded;
- `safe_load`: a checkpoint is read back as data only (no pickled code runs) and only whole.

May import: the standard library and torch only (no TorchTitan, no other room of FlashCP), so
that the safety of a run does not depend on the trainer or the data it runs.
"""
