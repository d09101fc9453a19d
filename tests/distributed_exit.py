"""Run by tests/test_distributed.py under torchrun: the recipe of the abort at exit that
`end_worker_process` prevents (torch 2.13, CPU): a gloo process group, then torch.distributed.fsdp
imported, a backward pass, collectives, the group destroyed, and the interpreter's shutdown.

    python distributed_exit.py [plain]   # `plain`: exit as Python does, for the control runs
"""

import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
import torch.distributed.fsdp  # noqa: E402  imported after the group is made, as the recipe has it

from grpo_cli.distributed import end_worker_process  # noqa: E402

layer = torch.nn.Linear(8, 8)
layer(torch.randn(2, 8)).sum().backward()
for _ in range(50):
    box = [list(range(100))]
    dist.broadcast_object_list(box, src=0)
dist.destroy_process_group()
print("ran", flush=True)
if sys.argv[1:] != ["plain"]:
    end_worker_process()
