"""Data parallel training under torchrun, on PyTorch's own distributed engine.

`grpo-train` started by `torchrun --nproc-per-node N ...` finds RANK / WORLD_SIZE / LOCAL_RANK in
its environment and joins the process group (NCCL on CUDA, gloo on CPU). Then:

- `data.prompts_per_step` is the global batch: every rank draws the same global batch of prompts
  (same shuffled order) and keeps its contiguous share of prompts_per_step / N prompts, with
  each prompt's whole group of G completions, so group statistics (advantages) need no
  communication;
- each rank samples with its own seed, a function of (seed, step, rank): no duplicated
  completions across ranks, and a rerun draws the same ones;
- gradients are synchronized by DistributedDataParallel (`trainer.distributed=ddp`), or the
  model is sharded by FSDP2's `fully_shard` (`trainer.distributed=fsdp`);
- the loss of each rank is its share of the global loss: sequence and token counts in its
  denominators are summed over ranks (`update.micro_batches`), so token_mean divides by the global
  token count; and since DDP averages gradients over ranks, each rank's loss is multiplied by N;
- metrics are reduced over ranks for logging (`reduce_metrics`), and only rank 0 prints, logs
  and writes checkpoints; every rank loads the same checkpoint on resume.

`World` says where this process stands among the run's processes (its rank, how many there
are, DDP or FSDP); `ONE_PROCESS` is a plain run, for which every function here is the identity
and calls no collective.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch

from grpo_cli.launch import launched_world_size


@dataclass(frozen=True)
class World:
    """This process among the run's processes (torchrun's RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    mode: str = "ddp"  # trainer.distributed

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


ONE_PROCESS = World()


def join_process_group(mode: str) -> World:
    """Join torchrun's process group (once); ONE_PROCESS when not launched by torchrun."""
    world_size = launched_world_size()
    if world_size <= 1:
        return ONE_PROCESS
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return World(dist.get_rank(), dist.get_world_size(), local_rank, mode)


def leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def end_worker_process() -> None:
    """End a torchrun worker whose run is over with `os._exit(0)`, skipping the interpreter's
    shutdown; outside torchrun, return and let Python exit as usual.

    Why: with torch 2.13 on CPU, a process that ran gloo collectives with torch.distributed.fsdp
    imported aborts in about one exit in five on a 2-core machine ("terminate called without an
    active exception", SIGABRT, no Python frame left: a C++ destructor at exit, after our last
    line). torchrun then reports a failed run although the run finished and saved everything
    (CI saw it once). Skipping the shutdown skips those destructors. By now every file of the
    run is closed (RunLogger.close, checkpoints written and renamed), and the process group is
    destroyed; what remains is flushing Python's own buffers and logging handlers (Hydra's log
    file), which is done here. tests/distributed_exit.py is the abort's recipe: the slow test
    in tests/test_distributed.py runs it through this function; `plain` runs it without.
    """
    if launched_world_size() <= 1:
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_device(setting: str, world: World) -> str:
    """Under torchrun each rank uses its own GPU: `cuda` / `auto` become cuda:LOCAL_RANK."""
    if world.enabled and torch.cuda.is_available() and setting.lower() in ("auto", "cuda"):
        return f"cuda:{world.local_rank}"
    return setting


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one rank's sampling at one step. Rank 0 keeps the single-process seed, so a
    one-process run is unchanged; other ranks are offset far beyond any step count."""
    return seed * 1_000_003 + step + rank * 1_000_000_007


def local_share(items: list[Any], world: World) -> list[Any]:
    """This rank's contiguous share of a global list whose length world_size divides.
    Example: 8 prompts, 2 ranks -> rank 0 keeps items 0..3, rank 1 items 4..7."""
    if not world.enabled:
        return items
    share = len(items) // world.world_size
    return items[world.rank * share : (world.rank + 1) * share]


def sum_over_ranks(values: list[float], world: World) -> list[float]:
    """Element-wise sums of `values` over all ranks (float64, so counts stay exact)."""
    return _all_reduce(values, world, "SUM")


def max_over_ranks(values: list[float], world: World) -> list[float]:
    """Element-wise maxima of `values` over all ranks."""
    return _all_reduce(values, world, "MAX")


def _all_reduce(values: list[float], world: World, operation: str) -> list[float]:
    if not world.enabled:
        return list(values)
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":  # NCCL reduces CUDA tensors only
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, operation))
    return tensor.cpu().tolist()


def _gathered(values: list[float], world: World) -> torch.Tensor:
    """Every rank's `values`, stacked in rank order: [world_size, len(values)], float64 on CPU."""
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":  # NCCL gathers CUDA tensors only
        tensor = tensor.cuda()
    ranks = [torch.empty_like(tensor) for _ in range(world.world_size)]
    dist.all_gather(ranks, tensor)
    return torch.stack(ranks).cpu()


def broadcast_from_main(value: Any, world: World) -> Any:
    """Rank 0's `value` on every rank (any picklable object)."""
    if not world.enabled:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(world: World) -> None:
    if world.enabled:
        import torch.distributed as dist

        dist.barrier()


# How each metric combines over ranks. Every rank holds the same number of completions, so the
# mean of the ranks' means is the global mean. Maxima stay maxima; work done adds up; the step
# takes as long as its slowest rank. Standard deviations are averaged (an approximation, said
# in docs/DISTRIBUTED.md); metrics every rank computes identically (beta, lr) are unchanged.
MAX_KEYS = ("completion/length_max", "ratio/max_deviation", "memory/rss_gb")
MAX_PREFIXES = ("time/",)
SUM_KEYS = ("tokens_per_second", "sampling/extra_rounds", "sampling/informative_groups", "sampling/sampled_groups")
SUM_SUFFIXES = ("/errors",)


def reduction_of(key: str) -> str:
    """ "max", "sum" or "mean": how metric `key` combines over ranks."""
    if key in MAX_KEYS or key.startswith(MAX_PREFIXES):
        return "max"
    if key in SUM_KEYS or key.endswith(SUM_SUFFIXES):
        return "sum"
    return "mean"


def reduce_metrics(metrics: dict[str, Any], world: World) -> dict[str, Any]:
    """One metrics row for the whole step from each rank's row (every rank gets the result).
    A value missing (None) on some rank is averaged over the ranks that have it."""
    if not world.enabled:
        return metrics
    keys = sorted(key for key, value in metrics.items() if isinstance(value, (int, float)) or value is None)
    present = [0.0 if metrics[key] is None else 1.0 for key in keys]
    values = [0.0 if metrics[key] is None else float(metrics[key]) for key in keys]
    ranks = _gathered(values + present, world)  # [world_size, 2 x keys]: one collective per step
    values, present = ranks[:, : len(keys)], ranks[:, len(keys) :].bool()
    sums, counts = values.sum(dim=0).tolist(), present.sum(dim=0).tolist()
    maxima = values.masked_fill(~present, -math.inf).max(dim=0).values.tolist()
    reduced = dict(metrics)
    for index, key in enumerate(keys):
        if counts[index] == 0:
            reduced[key] = None
            continue
        how = reduction_of(key)
        value = maxima[index] if how == "max" else sums[index] if how == "sum" else sums[index] / counts[index]
        reduced[key] = int(value) if isinstance(metrics[key], int) and not isinstance(metrics[key], bool) else value
    return reduced


def wrap_for_training(models: Any, world: World) -> Any:
    """The models prepared for data parallel training (unchanged in one process).

    ddp: `models.ddp` is a DistributedDataParallel wrapper of the policy (which broadcasts
    rank 0's weights at construction); the loss goes through it, sampling, the reference pass
    (LoRA: adapter off) and checkpoints through the policy itself, which shares its parameters.

    fsdp: FSDP2's `fully_shard` on every decoder layer, then on the whole policy (and likewise on
    a full fine-tune's frozen reference): each rank keeps 1/N of the weights, gradients and
    optimizer state and gathers a layer's weights only for its forward and backward.
    """
    if not world.enabled:
        return models
    from dataclasses import replace

    if world.mode == "fsdp":
        for model in (models.policy, models.reference):
            if model is not None:
                _shard(model)
        return models
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [models.device.index] if models.device.type == "cuda" else None
    return replace(models, ddp=DistributedDataParallel(models.policy, device_ids=device_ids))


def _shard(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model's base
    layer_names = set(getattr(base, "_no_split_modules", None) or ())  # e.g. {"Qwen2DecoderLayer"}
    for module in model.modules():
        if type(module).__name__ in layer_names:
            fully_shard(module)
    # The root group (embeddings, final norm, head) on the transformers model itself: PEFT's
    # generate calls it directly, past the PeftModel's own forward.
    fully_shard(base)


def is_sharded(world: World) -> bool:
    return world.enabled and world.mode == "fsdp"


def full_states(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World) -> tuple[Any, dict[str, Any]]:
    """(model state dict or None, optimizer state dict) for a checkpoint. Under FSDP the shards
    are gathered into full tensors on rank 0 (a collective: every rank calls it); otherwise the
    model state is None (save_pretrained reads the model itself) and the optimizer's own."""
    if not is_sharded(world):
        return None, optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(policy, options=options), get_optimizer_state_dict(policy, optimizer, options=options)


def load_optimizer_state(
    policy: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], world: World
) -> None:
    """Restore the optimizer from a checkpoint's (full) state dict, sharding it under FSDP."""
    if not is_sharded(world):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(policy, optimizer, state, options=StateDictOptions(full_state_dict=True))


def weights_spread(parameters: list[torch.Tensor], world: World) -> float:
    """max - min over ranks of a float64 checksum of the trainable weights: exactly 0 while the
    ranks hold the same weights (DDP), which `distributed/weights_spread` shows every step."""
    checksum = float(sum(parameter.detach().double().sum() for parameter in parameters))
    highest, negated_lowest = max_over_ranks([checksum, -checksum], world)
    return highest + negated_lowest
