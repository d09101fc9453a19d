"""`grpo-filter`: keep the prompts that can still teach the current model something.

    grpo-filter conf=math_0.5b data.path=train.jsonl +out=filtered/train.jsonl

samples sampler.group_size completions for every prompt of data.path with model.*, scores them
with reward.*, and keeps a prompt exactly when training would give its group a non-zero
advantage: the group's reward std (sample std over the G rewards, as in grpo_cli.algorithm.advantages) is
at least trainer.std_threshold. Every other group is all-equal and would only cost sampling time.
Those are counted as

- too easy: every completion got the highest reward any completion in the file got (the model
  already does as well as it ever does);
- too hard: every completion got some lower reward.

If every completion in the file got the same reward there is no "highest" to compare with; then
a reward above 0 counts as too easy and 0 or below as too hard. The split only feeds the
summary: what is kept depends on the std alone.

Writes OUT (JSONL: the kept records, every field as read, in input order) and OUT's stem +
`.summary.json` beside it (the counts, and each prompt's G rewards, mean, std and verdict), both
atomically: a temp file renamed into place, so a stopped run leaves the old file or none.
Prompts go through the model data.prompts_per_step at a time; trainer.seed seeds the sampling.
The model is model.* as configured or, with trainer.resume=CHECKPOINT (or trainer.resume=true
trainer.output_dir=RUN: its newest), a training run's policy at that checkpoint, since a partly
trained policy finds other prompts easy than the base model does.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from grpo_cli.algorithm.advantages import group_advantages
from grpo_cli.config import ConfigError
from grpo_cli.data.prompts import PromptSource, batches, load_rows
from grpo_cli.data.tasks import synthetic_task_name
from grpo_cli.models.loading import load_models, resolve_device
from grpo_cli.rewards.api import RewardScorer
from grpo_cli.sampling import run_sampler
from grpo_cli.state import find_resume_checkpoint, seed_everything
from grpo_cli.validation import validate

KEPT, TOO_EASY, TOO_HARD = "kept", "too_easy", "too_hard"
VERDICT_LABELS = {KEPT: "kept", TOO_EASY: "too easy", TOO_HARD: "too hard"}


@dataclass
class FilterResult:
    out: Path
    summary_path: Path
    counts: dict[str, int]  # kept / too_easy / too_hard / total
    verdicts: list[str]  # [N] one per input record, in input order


def output_paths(cfg: Any) -> tuple[Path, Path]:
    """(OUT, its summary file) from `+out=...`; ConfigError naming `out` when it is unusable."""
    value = OmegaConf.select(cfg, "out")
    if value is None or value == "":
        raise ConfigError(
            "out is not set: add +out=OUT.jsonl, the file the kept prompts are written to (the `+` "
            "is needed because out is not a training key), e.g. grpo-filter data.path=train.jsonl "
            "+out=train.filtered.jsonl."
        )
    if isinstance(value, (DictConfig, ListConfig)):
        raise ConfigError(f"out={value}: give one file path, e.g. +out=train.filtered.jsonl.")
    out = Path(str(value)).expanduser()
    if out.is_dir():
        raise ConfigError(f"out={value} is a folder; give the file to write, e.g. +out={out / 'kept.jsonl'}.")
    if out.suffix.lower() != ".jsonl":
        raise ConfigError(
            f"out={value}: the filtered prompts are written as JSONL, so the name must end in "
            f".jsonl (e.g. +out={out.with_suffix('.jsonl')}) for data.path to read it back."
        )
    summary = out.with_name(out.stem + ".summary.json")
    data_path = str(cfg.data.path)
    if synthetic_task_name(data_path) is None:
        source = Path(data_path).expanduser().resolve()
        for key, path in (("out", out), ("out's summary file", summary)):
            if path.resolve() == source:
                raise ConfigError(
                    f"{key} {path} is the input file data.path={data_path}; the filter never "
                    "overwrites its input. Give +out another path, e.g. "
                    f"+out={source.with_name(source.stem + '.filtered.jsonl')}."
                )
    return out, summary


def filter_file(cfg: Any) -> FilterResult:
    """Sample, score and classify every prompt of data.path; write the kept ones and a summary."""
    out, summary_path = output_paths(cfg)  # the likeliest mistake, caught before anything loads
    validate(cfg)
    run_folder = Path(cfg.trainer.output_dir or ".")  # where trainer.resume=true finds checkpoints/
    checkpoint = find_resume_checkpoint(cfg.trainer.resume, run_folder)
    make_folder_for(out)
    console = Console(highlight=False, soft_wrap=True)  # soft_wrap: paths stay whole when copied
    rows = load_rows(cfg.data.path)
    try:
        scores = score_prompts(cfg, rows, checkpoint, console)
    except KeyboardInterrupt:
        console.print(f"Interrupted: nothing written ({out} is as it was).")
        raise SystemExit(130) from None

    verdicts = classify(scores.totals, scores.informative, cfg.trainer.std_threshold)
    kept_rows = [row for row, verdict in zip(rows, verdicts) if verdict == KEPT]
    counts = {verdict: verdicts.count(verdict) for verdict in VERDICT_LABELS}
    counts["total"] = len(verdicts)
    summary = {
        "data_path": str(cfg.data.path),
        "out": str(out),
        "model": str(cfg.model.name_or_path),
        "checkpoint": str(checkpoint) if checkpoint else None,
        "group_size": int(cfg.sampler.group_size),
        "std_threshold": float(cfg.trainer.std_threshold),
        "seed": int(cfg.trainer.seed),
        "counts": counts,
        "reward_errors": scores.error_counts,
        "prompts": [  # record: the 1-based position in data.path, as in the data error messages
            {
                "record": number,
                "verdict": verdict,
                "reward_mean": group.mean().item(),
                "reward_std": group.std().item(),
                "rewards": group.tolist(),
            }
            for number, (verdict, group) in enumerate(zip(verdicts, scores.totals), start=1)
        ],
    }
    write_atomically(out, "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in kept_rows))
    write_atomically(summary_path, json.dumps(summary, indent=2) + "\n")

    for name, count in scores.error_counts.items():
        if count:
            console.print(
                f"reward function {name} failed on {count} completions (first: "
                f"{scores.first_errors.get(name)}); those scored None (0 in the total)"
            )
    print_summary(console, verdicts, scores.totals.mean(dim=1).tolist(), out, summary_path)
    if not kept_rows:
        console.print(
            f"No prompt kept: every group's rewards were equal, so {out} is empty. More "
            "samples (sampler.group_size), a higher sampler.temperature or other data may "
            "give groups whose rewards differ."
        )
    return FilterResult(out, summary_path, counts, verdicts)


def make_folder_for(out: Path) -> None:
    """Create OUT's folder now, so a path that cannot be written fails before hours of sampling."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"out={out}: cannot create its folder {out.parent} ({error.strerror}). "
            "Point +out at a folder you can write to."
        ) from None
    if not os.access(out.parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"out={out}: the folder {out.parent} is not writable by this user. Point +out at a folder you can write to."
        )


@dataclass
class PromptScores:
    totals: torch.Tensor  # [N, G] each prompt's G total rewards (reward.clip applied, None as 0)
    informative: torch.Tensor  # [N] bool: training would give the group non-zero advantages
    error_counts: dict[str, int]  # reward function -> completions whose score was lost
    first_errors: dict[str, str]  # reward function -> why its first failure happened


def score_prompts(cfg: Any, rows: list[dict[str, Any]], checkpoint: Optional[Path], console: Console) -> PromptScores:
    """G completions for each row from the model (at `checkpoint`, a training run's policy, if
    given), their rewards, and which groups differ."""
    trainer = cfg.trainer
    scorer = RewardScorer.from_config(
        cfg.reward, trainer.std_eps, cfg.sampler.max_new_tokens
    )  # imports each _target_ before loading
    seed_everything(trainer.seed)
    models = load_models(
        cfg.model,
        0.0,
        resolve_device(trainer.device),  # beta 0: no reference model
        checkpoint=str(checkpoint) if checkpoint else None,
    )
    prompts = PromptSource(cfg.data, models.tokenizer, rows=rows)
    sampler = run_sampler(cfg, models, rows)
    totals, informative = [], []  # per batch: [B, G], [B]
    error_counts: dict[str, int] = {}
    first_errors: dict[str, str] = {}
    progress = Progress(
        TextColumn("[bold]filter"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        disable=not console.is_terminal,
    )
    task = progress.add_task("filter", total=len(rows))
    done = 0
    with progress, contextlib.closing(sampler):  # sampler=vllm: the engine goes at the end
        for chunk in batches(rows, cfg.data.prompts_per_step):
            rewards = scorer.score(sampler.sample(models.policy, prompts.make_batch(chunk)))
            # The very rule that zeroes a group's advantages in training (on the shaped rewards
            # with reward.normalize_each, else on the totals).
            zero_std = group_advantages(rewards.for_advantages, trainer.std_eps, trainer.std_threshold).zero_std_groups
            totals.append(rewards.total)
            informative.append(~zero_std)
            for name, count in rewards.error_counts.items():
                error_counts[name] = error_counts.get(name, 0) + count
            for name, why in rewards.errors.items():
                first_errors.setdefault(name, why)
            done += len(chunk)
            progress.update(task, completed=done)
            if not console.is_terminal:
                console.print(f"filter: {done}/{len(rows)} prompts")
    return PromptScores(torch.cat(totals), torch.cat(informative), error_counts, first_errors)


def classify(rewards: torch.Tensor, informative: torch.Tensor, std_threshold: float) -> list[str]:
    """rewards [N, G] (the totals), informative [N] bool -> one verdict per prompt.

    Groups that are not informative are too easy when their mean is within std_threshold of the
    highest reward in `rewards`, too hard otherwise; when all rewards are within std_threshold of
    each other, too easy when above 0. Example, std_threshold 1e-4:
        rewards [[1, 1], [0, 0], [0, 1]], informative [F, F, T] -> too_easy, too_hard, kept
        rewards [[0, 0], [0, 0]],         informative [F, F]    -> too_hard, too_hard
    """
    best, worst = rewards.max().item(), rewards.min().item()
    one_value = best - worst <= std_threshold
    verdicts = []
    for mean, keep in zip(rewards.mean(dim=1).tolist(), informative.tolist()):
        at_the_top = mean > 0 if one_value else mean >= best - std_threshold
        verdicts.append(KEPT if keep else TOO_EASY if at_the_top else TOO_HARD)
    return verdicts


def write_atomically(path: Path, text: str) -> None:
    """Write to a temp file beside `path`, then rename it over `path`: readers see the old file
    or the whole new one, never half of one (an interrupted run, a full disk)."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # beside it: the rename stays on one disk
    try:
        with temporary.open("w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def print_summary(console: Console, verdicts: list[str], means: list[float], out: Path, summary_path: Path) -> None:
    """Counts and mean reward per verdict: a table on a terminal, plain lines otherwise."""
    total = len(verdicts)
    lines = []  # (label, count, share, mean reward of the prompts' means)
    for verdict, label in VERDICT_LABELS.items():
        picked = [mean for mean, v in zip(means, verdicts) if v == verdict]
        lines.append((label, len(picked), len(picked) / total, _mean(picked)))
    lines.append(("total", total, 1.0, _mean(means)))
    spread = f"min {min(means):.3f}, median {statistics.median(means):.3f}, max {max(means):.3f}"
    files = {"kept prompts": f"{out} ({verdicts.count(KEPT)} records)", "summary": str(summary_path)}
    if not console.is_terminal:  # logs and CI: plain lines that never wrap or truncate
        console.print("grpo-filter summary")
        for label, count, share, mean in lines:
            console.print(f"  {label}: {count} prompts ({share:.1%}), mean reward {_format(mean)}")
        console.print(f"  per-prompt mean reward: {spread}")
        for key, value in files.items():
            console.print(f"  {key}: {value}")
        return
    table = Table(title="grpo-filter summary", caption=f"per-prompt mean reward: {spread}")
    for column in ("prompts", "count", "share", "mean reward"):
        table.add_column(column, justify="left" if column == "prompts" else "right")
    for label, count, share, mean in lines:
        table.add_row(label, str(count), f"{share:.1%}", _format(mean))
    console.print(table)
    for key, value in files.items():
        console.print(f"{key}: {value}")


def _mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _format(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"
