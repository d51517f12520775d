"""A script whose rank 1 fails after the process group is up, while the others wait in a collective."""

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise RuntimeError("rank 1 fails on purpose")
dist.barrier()
