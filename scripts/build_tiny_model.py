"""Build the tiny local model of the embedded default into a folder of your choice.

    python scripts/build_tiny_model.py OUT_DIR [--warm-start-steps 120] [--warm-start-lr 5e-4] [--seed 0]

The folder is an ordinary Hugging Face model folder: `grpo-train model.name_or_path=OUT_DIR`.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from grpo_cli.models.tiny import TINY_MODELS, build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--name", default="tiny-addition", choices=sorted(TINY_MODELS))
    parser.add_argument("--warm-start-steps", type=int)
    parser.add_argument("--warm-start-lr", type=float)
    parser.add_argument("--seed", type=int)
    args = parser.parse_args()
    changes = {
        key: value
        for key, value in (
            ("warm_start_steps", args.warm_start_steps),
            ("warm_start_lr", args.warm_start_lr),
            ("seed", args.seed),
        )
        if value is not None
    }
    spec = dataclasses.replace(TINY_MODELS[args.name], **changes)
    build_tiny_model(spec, args.out_dir)


if __name__ == "__main__":
    main()
