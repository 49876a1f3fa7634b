"""Command line: `python -m hybrid_train STAGE --config FILE [--resume]` (or under torchrun),
and `python -m hybrid_train gguf-to-hf FILE.gguf OUT_DIR` to turn a GGUF teacher into a HF directory."""

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

from hybrid_train.errors import TrainError
from hybrid_train.stages import STAGES, parse


def load_config(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise TrainError(f"config file not found: {file}")
    try:
        if file.suffix == ".json":
            raw = json.loads(file.read_text())
        else:
            import yaml

            raw = yaml.safe_load(file.read_text())
    except Exception as e:
        raise TrainError(f"{file} is not valid {file.suffix[1:] or 'YAML'}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise TrainError(f"{file} must hold a mapping of config keys")
    return raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybrid_train", description=__doc__)
    sub = parser.add_subparsers(dest="stage", required=True)
    for name, (fn, _) in STAGES.items():
        p = sub.add_parser(name, help=(fn.__doc__ or "").split("\n")[0])
        p.add_argument("--config", required=True, help="YAML or JSON file with the stage's keys")
        p.add_argument("--resume", action="store_true", help="continue from the checkpoint in the config's out")
    g = sub.add_parser("gguf-to-hf", help="write a GGUF teacher as a Hugging Face directory")
    g.add_argument("gguf")
    g.add_argument("out")
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.disable_progress_bar()  # ours are the rich bars; theirs would interleave with them
    try:
        if args.stage == "gguf-to-hf":
            from hybrid_train.teacher import gguf_to_hf

            print(gguf_to_hf(args.gguf, args.out))
            return 0
        fn, cls = STAGES[args.stage]
        fn(parse(cls, load_config(args.config)), resume=args.resume)
    except TrainError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if dist.is_initialized():  # a torchrun group left to the interpreter's teardown can abort a rank (gloo's threads)
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
