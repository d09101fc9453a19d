"""Run by tests/test_distributed.py under `torchrun --nproc-per-node 2`: one update of the tiny
model on a fixed global batch, split over the ranks with DDP, against one process training on
the whole batch. Rank 0 writes what it measured to OUT as JSON.

usage: torchrun --nproc-per-node 2 distributed_equivalence.py MODEL_DIR AGGREGATION OUT [ddp|fsdp]
"""

from __future__ import annotations

import json
import sys

import torch

from grpo_cli.algorithm.advantages import group_advantages
from grpo_cli.algorithm.optim import make_optimizer, make_scheduler
from grpo_cli.algorithm.update import update_policy
from grpo_cli.data.prompts import PromptSource
from grpo_cli.distributed import (
    ONE_PROCESS,
    broadcast_from_main,
    end_worker_process,
    join_process_group,
    leave_process_group,
    wrap_for_training,
)
from grpo_cli.models.loading import load_models, trainable_parameters
from grpo_cli.records import Advantages
from grpo_cli.sampling import make_sampler
from helpers import config

PROMPTS, GROUP = 4, 4  # 16 completions: 8 per rank, in micro-batches of 4 (gradient accumulation)


def full(tensor):
    """The whole tensor: FSDP holds a shard of it on each rank (gathering is a collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def train_once(cfg, rollout, advantages, world):
    """One update_policy call on fresh tiny weights; (stats, gradients, weights after)."""
    models = wrap_for_training(load_models(cfg.model, 0.04, torch.device("cpu")), world)
    parameters = trainable_parameters(models.policy)
    optimizer = make_optimizer(cfg.optimizer, parameters)
    scheduler = make_scheduler(cfg.optimizer, optimizer, 1)
    gradients = []  # read just before the step: update_policy frees them after it
    optimizer.register_step_pre_hook(lambda *_: gradients.extend(full(p.grad).clone() for p in parameters))
    stats = update_policy(
        models, rollout, advantages, optimizer, scheduler, cfg.trainer, cfg.optimizer.max_grad_norm, 0.04, world
    )
    return stats, gradients, [full(p.detach()).clone() for p in parameters]


def main() -> None:
    model_dir, aggregation, out = sys.argv[1:4]
    mode = sys.argv[4] if len(sys.argv) > 4 else "ddp"
    world = join_process_group(mode)
    cfg = config(
        model_dir,
        f"data.prompts_per_step={PROMPTS}",
        f"sampler.group_size={GROUP}",
        "sampler.max_new_tokens=6",
        "trainer.micro_batch_size=4",
        f"trainer.loss_aggregation={aggregation}",
        "optimizer.lr=1e-3",
        "optimizer.max_grad_norm=0",
        # Adam moves a weight by lr * g / (|g| + eps): with the default eps 1e-8, a
        # rounding difference d in a gradient near 0 moves it by up to lr * d / 1e-8, so
        # the weights would agree only as far as the summation order of the CPU allows.
        # With eps 1e-3 the two sides' weights differ by at most lr * d / 1e-3 = d / 1:
        # the test's 1e-5 bound on weights follows from its 1e-6 bound on gradients.
        "optimizer.kwargs={eps: 1e-3}",
        # torchrun runs one pass per completion (update.py); so does the whole-batch
        # process, so the two agree to the last bits rather than to float rounding.
        "trainer.share_prompt_pass=false",
    )
    torch.manual_seed(0)
    models = load_models(cfg.model, 0.0, torch.device("cpu"))
    batch = PromptSource(cfg.data, models.tokenizer).next_batch()
    # The same completions everywhere: rank 0 samples, the others receive them.
    rollout = broadcast_from_main(make_sampler(cfg.sampler, models.tokenizer).sample(models.policy, batch), world)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    advantages = group_advantages(rewards, std_eps=1e-4, std_threshold=1e-4)

    share = PROMPTS * GROUP // world.world_size
    rows = list(range(world.rank * share, (world.rank + 1) * share))
    local = Advantages(advantages.values[rows], advantages.zero_std_groups)
    stats, gradients, weights = train_once(cfg, rollout.select(rows), local, world)
    if world.is_main:
        whole_stats, whole_gradients, whole_weights = train_once(cfg, rollout, advantages, ONE_PROCESS)
        result = {
            "world_size": world.world_size,
            "mode": world.mode,
            "rows": len(rows),
            "loss": [stats.loss, whole_stats.loss],
            "kl": [stats.kl, whole_stats.kl],
            "tokens": [stats.tokens, whole_stats.tokens],
            "entropy": [stats.entropy, whole_stats.entropy],
            "max_gradient_difference": max((a - b).abs().max().item() for a, b in zip(gradients, whole_gradients)),
            "max_gradient": max(g.abs().max().item() for g in whole_gradients),
            "max_weight_difference": max((a - b).abs().max().item() for a, b in zip(weights, whole_weights)),
        }
        with open(out, "w") as handle:
            json.dump(result, handle)
    leave_process_group()


if __name__ == "__main__":
    main()
    # As the product's worker ends (cli.main): with gloo collectives run and FSDP imported, a normal
    # interpreter exit aborts in about one exit in five on torch 2.13 CPU (distributed.py says why).
    end_worker_process()
