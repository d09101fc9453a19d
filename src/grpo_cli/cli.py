"""`grpo-train`: the Hydra entry point. Composes the config, then hands it to pipeline.run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict
from rich.console import Console

from grpo_cli.config import ConfigError, register_configs


def config_dir() -> str:
    """The `conf/` folder at the top of the project (this package is installed editable)."""
    return str(Path(__file__).resolve().parents[2] / "conf")


register_configs()


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def main(cfg: DictConfig) -> None:
    from transformers.utils import logging as transformers_logging

    from grpo_cli.pipeline import run  # torch and transformers load only once a run starts

    transformers_logging.disable_progress_bar()  # per-shard bars would drown the run's own output

    with open_dict(cfg):
        if not cfg.trainer.output_dir:
            cfg.trainer.output_dir = HydraConfig.get().runtime.output_dir
    try:
        run(cfg)
    except ConfigError as error:
        # Bad input is the user's to fix: say what and where, no traceback (unless asked for).
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        Console(stderr=True).print(f"[bold red]grpo-train: error[/] {error}", highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
