"""What the launcher told this process, read from its environment without importing torch:
torchrun's WORLD_SIZE, or, in a multi-task SLURM job started by submitit, the same variables
written from SLURM's. Validation and the memory plan need it before anything heavy loads."""

from __future__ import annotations

import os


def launched_world_size() -> int:
    """WORLD_SIZE as torchrun set it (1 when not launched by torchrun)."""
    export_slurm_environment()
    return int(os.environ.get("WORLD_SIZE", "1"))


def export_slurm_environment() -> None:
    """In a SLURM job of several tasks started by the submitit launcher (hydra/launcher=
    slurm_node: one task per GPU) there is no torchrun: submitit's helper writes the variables
    torchrun would have set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) from
    SLURM's, so the tasks join one process group. Anywhere else this does nothing."""
    if "WORLD_SIZE" in os.environ or "SUBMITIT_FOLDER" not in os.environ:
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return
    from submitit.helpers import TorchDistributedEnvironment

    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
