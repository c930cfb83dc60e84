"""Export a FlashCP checkpoint as a Hugging Face model folder.

    python -m flashcp.titan.export --checkpoint outputs/checkpoint/step-100 --out hf-model
    python -m flashcp.titan.export --checkpoint ... --out ... --dtype bfloat16 --max-shard-size 5GB

The checkpoint is verified against its manifest first, and the model it holds is read from that
manifest (no job file needed); the folder written (`flashcp.titan.hf.export`: model.safetensors or
shards with an index, config.json with the RoPE settings trained, the job's tokenizer files)
loads with `transformers.AutoModelForCausalLM.from_pretrained(out)`. An existing non-empty
`--out` is refused; a crash leaves no partial folder under its name. Bad input: one `error:` line,
exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flashcp.titan.hf.export import DTYPES, export, ExportError, parse_size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="a checkpoint folder: <dump>/checkpoint/step-N")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="the HF folder to write (absent or empty)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="weights' dtype (default: the checkpoint's)")
    parser.add_argument("--max-shard-size", default="5GB",
                        help="one safetensors file up to this size (default 5GB)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        files = export(args.checkpoint, args.out, args.dtype, parse_size(args.max_shard_size))
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} to {args.out}: {', '.join(p.name for p in files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
