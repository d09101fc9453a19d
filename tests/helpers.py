"""Running the real console scripts (`grpo-train`, `grpo-filter`) from tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

SCRIPTS_DIR = Path(sys.executable).parent
GRPO_TRAIN = str(SCRIPTS_DIR / "grpo-train")
TESTS_DIR = str(Path(__file__).resolve().parent)  # on PYTHONPATH: `_target_: test_module.function`
MEASURED_KEYS = ("time/", "tokens_per_second", "memory/")  # timed or measured, not computed


# A reward that gives every step a gradient by construction, whatever was sampled: the premise
# of a test that needs the weights to move must not rest on one CPU's float rounding.
ALTERNATING_REWARD = "reward.functions=[{_target_: helpers.alternating_reward, weight: 1.0}]"


def alternating_reward(prompts, completions, **_):
    """1, 0, 1, 0, ... by position in the batch: every group of an even size holds both rewards,
    so every group has a non-zero advantage (ALTERNATING_REWARD names it in a config)."""
    return [float(index % 2 == 0) for index in range(len(completions))]


def act_as_an_avx512_bf16_cpu(monkeypatch) -> None:
    """bitsandbytes believes this CPU has AVX512-BF16: Linear4bit layers made from now on take
    its packed-layout decision (tests/test_cpu_paths.py). `raising=True`: a renamed detection
    fails the test, not silently."""
    import bitsandbytes.nn.modules

    monkeypatch.setattr(bitsandbytes.nn.modules, "has_avx512bf16", lambda: True, raising=True)


def computed_rows(rows: list[dict], leave_out: tuple[str, ...] = ()) -> list[dict]:
    """metrics.jsonl rows without the measured keys (and those starting with `leave_out`): what
    two runs of the same seed must agree on exactly."""
    return [{k: v for k, v in row.items() if not k.startswith((*MEASURED_KEYS, *leave_out))} for row in rows]


def load_script(name: str):
    """scripts/NAME.py as a module (registered in sys.modules, so its pickled or imported names resolve)."""
    import importlib.util

    path = Path(TESTS_DIR).parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_script(
    program: str, *overrides: str, cwd: Path | None = None, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`PROGRAM OVERRIDES...` (a console script of this venv) in a child process; raises with
    its output if it fails and `check`."""
    result = subprocess.run(
        [str(SCRIPTS_DIR / program), *overrides],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        timeout=900,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{program} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def input_error(program: str, *overrides: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run PROGRAM on bad input: expect exit code 2, one `PROGRAM: error` message on stderr and no
    traceback. Returns the message, whitespace joined (the console wraps long lines)."""
    result = run_script(program, *overrides, cwd=cwd, check=False, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    assert "Traceback" not in output
    assert f"{program}: error" in result.stderr
    return " ".join(result.stderr.split())


def grpo_train(
    *overrides: str, cwd: Path | None = None, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`grpo-train OVERRIDES...` in a child process; raises with its output if it fails."""
    return run_script("grpo-train", *overrides, cwd=cwd, check=check, env=env)


def config(tiny_model_dir, *overrides: str):
    """The typed config for in-process runs on the tiny model: 2 prompts x G=4, 4 new tokens."""
    from omegaconf import OmegaConf

    from grpo_cli.config import Config

    cfg = OmegaConf.structured(Config)
    cfg.merge_with_dotlist(
        [
            f"model.name_or_path={tiny_model_dir}",
            "data.path=synthetic:addition",
            "data.prompts_per_step=2",
            "sampler.group_size=4",
            "sampler.max_new_tokens=4",
            "optimizer.lr=1e-2",
            *overrides,
        ]
    )
    return cfg


class OneStep(NamedTuple):
    """What one_step did: the models after it, what it trained on, and how many trainable
    parameter tensors the update changed, of how many."""

    models: Any  # grpo_cli.models.loading.Models
    rollout: Any  # grpo_cli.records.Rollout
    stats: Any  # grpo_cli.algorithm.update.UpdateStats
    changed: int
    parameters: int


def one_step(cfg, edit_rollout=None) -> OneStep:
    """Sample, reward by hand (alternating 1/0 so every group has signal), update once.

    `edit_rollout(rollout)` may change the rollout before the update (e.g. its truncated flags).
    """
    import torch

    from grpo_cli.algorithm.advantages import group_advantages
    from grpo_cli.algorithm.optim import make_optimizer, make_scheduler
    from grpo_cli.algorithm.update import update_policy
    from grpo_cli.config import beta_schedule
    from grpo_cli.data.prompts import PromptSource
    from grpo_cli.models.loading import load_models, trainable_parameters
    from grpo_cli.sampling import make_sampler

    torch.manual_seed(0)
    betas = beta_schedule(cfg.trainer.beta)
    models = load_models(cfg.model, betas.peak, torch.device("cpu"))
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    rollout = make_sampler(cfg.sampler, models.tokenizer).sample(models.policy, batch)
    if edit_rollout is not None:
        edit_rollout(rollout)
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0]] * batch.size)
    advantages = group_advantages(rewards, std_eps=1e-4, std_threshold=1e-4)
    parameters = trainable_parameters(models.policy)
    before = [p.detach().clone() for p in parameters]
    optimizer = make_optimizer(cfg.optimizer, parameters)
    scheduler = make_scheduler(cfg.optimizer, optimizer, cfg.trainer.num_iterations)
    stats = update_policy(
        models,
        rollout,
        advantages,
        optimizer,
        scheduler,
        cfg.trainer,
        cfg.optimizer.max_grad_norm,
        beta=betas.at(0),
    )
    changed = sum(not torch.equal(b, p) for b, p in zip(before, parameters))
    return OneStep(models, rollout, stats, changed, len(parameters))


def token_counts(model_dir, backend: str, temperature: float, samples: int, seed: int, *overrides: str):
    """(Counter of first tokens, Counter of second tokens) of `samples` completions of the first
    prompt of config(model_dir, *overrides), drawn by sampler `backend` after manual_seed(seed)."""
    from collections import Counter

    import torch

    from grpo_cli.data.prompts import PromptSource
    from grpo_cli.models.loading import load_models
    from grpo_cli.sampling import make_sampler

    cfg = config(
        model_dir,
        f"sampler.backend={backend}",
        "data.prompts_per_step=1",
        f"sampler.group_size={samples}",
        "sampler.max_new_tokens=2",
        "sampler.min_new_tokens=2",
        f"sampler.temperature={temperature}",
        *overrides,
    )
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    torch.manual_seed(seed)
    ids = make_sampler(cfg.sampler, models.tokenizer).sample(models.policy, batch).completion_ids
    return Counter(ids[:, 0].tolist()), Counter(ids[:, 1].tolist())


def homogeneity_p_value(first, second) -> float:
    """Two-sample chi-square test of equal distributions (Counters of equal sample sizes): sum over
    tokens of (a - b)^2 / (a + b), tokens seen fewer than 10 times in both together pooled into one."""
    import torch

    pooled, cells = [0, 0], []
    for token in first.keys() | second.keys():
        a, b = first[token], second[token]
        if a + b < 10:
            pooled[0], pooled[1] = pooled[0] + a, pooled[1] + b
        else:
            cells.append((a, b))
    if sum(pooled) > 0:
        cells.append(tuple(pooled))
    statistic = sum((a - b) ** 2 / (a + b) for a, b in cells)
    freedom = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2), torch.tensor(statistic / 2)))


def multinomial_draw(scores, greedy: bool):
    """The draw `generate` makes (torch.multinomial on the softmax of the warped scores), in the
    signature of grpo_cli.sampling.fast.draw_tokens: patched in, the fast sampler draws generate's tokens."""
    import torch

    return scores.argmax(dim=-1) if greedy else torch.multinomial(scores.softmax(dim=-1), 1).squeeze(1)
