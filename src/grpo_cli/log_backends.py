"""The logger backends of the `logger` group: where a step's scalars and sample groups go besides
metrics.jsonl and samples.jsonl (which are always written).

Each backend has `log_scalars(scalars, step)`, `log_samples(entries, step)` and `close()`.
TensorBoard is a dependency; wandb and MLflow are imported only when selected, and `validate`
has already said which package to install if one is missing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from grpo_cli.config import LoggerConfig
from grpo_cli.console import conversation_lines, samples_text

TENSORBOARD_FOLDER = "tensorboard"
MLFLOW_RUN_FILE = "mlflow_run_id.txt"  # in the run folder: a resumed run logs to the same MLflow run


class TensorBoardBackend:
    def __init__(self, output_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: on resume, events the stopped run wrote after its checkpoint are dropped
        # (they are redone), as rows are dropped from metrics.jsonl.
        self.writer = SummaryWriter(
            log_dir=str(output_dir / TENSORBOARD_FOLDER), purge_step=start_step + 1 if start_step else None
        )

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def log_samples(self, entries: list[dict[str, Any]], step: int) -> None:
        # TensorBoard's text plugin renders markdown: indent by four spaces for a code block.
        text = "\n\n".join("    " + samples_text(entry).replace("\n", "\n    ") for entry in entries)
        self.writer.add_text("samples", text, step)

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    def __init__(self, settings: LoggerConfig, output_dir: Path, config: dict[str, Any]):
        import wandb

        self.wandb = wandb
        # One wandb run per run folder: the id is derived from the folder, so a resume continues it.
        run_id = hashlib.sha1(str(output_dir.resolve()).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=settings.project,
            name=settings.run_name or output_dir.name,
            dir=str(output_dir),
            config=config,
            id=run_id,
            resume="allow",
        )

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def log_samples(self, entries: list[dict[str, Any]], step: int) -> None:
        columns = ["step", "prompt", "completion", "reward", "advantage"]
        data = [  # a multi-turn completion is its whole conversation, one message a line
            [step, entry["prompt"], "\n".join(conversation_lines(entry, index)), reward, advantage]
            for entry in entries
            for index, (reward, advantage) in enumerate(zip(entry["rewards"], entry["advantages"]))
        ]
        self.run.log({"samples": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowBackend:
    def __init__(self, settings: LoggerConfig, output_dir: Path, config: dict[str, Any]):
        import mlflow

        self.mlflow = mlflow
        mlflow.set_experiment(settings.project)
        id_file = output_dir / MLFLOW_RUN_FILE
        if id_file.is_file():  # a resumed run continues its MLflow run
            mlflow.start_run(run_id=id_file.read_text().strip())
        else:
            run = mlflow.start_run(run_name=settings.run_name or output_dir.name)
            id_file.write_text(run.info.run_id)
            mlflow.log_dict(config, "config.json")

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(scalars, step=step)

    def log_samples(self, entries: list[dict[str, Any]], step: int) -> None:
        self.mlflow.log_text("\n\n".join(samples_text(entry) for entry in entries), f"samples/step-{step:06d}.txt")

    def close(self) -> None:
        self.mlflow.end_run()


def open_backends(settings: LoggerConfig, output_dir: Path, start_step: int, config: dict[str, Any]) -> list[Any]:
    backends: list[Any] = []
    if settings.tensorboard:
        backends.append(TensorBoardBackend(output_dir, start_step))
    if settings.wandb:
        backends.append(WandbBackend(settings, output_dir, config))
    if settings.mlflow:
        backends.append(MlflowBackend(settings, output_dir, config))
    return backends
