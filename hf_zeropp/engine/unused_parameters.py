"""Parameters that get a gradient on some ranks and not on others (a mixture of experts routing each rank's tokens to
different experts), treated as DDP's ``find_unused_parameters=True`` treats them.

FSDP2 builds a unit's reduce-scatter input from the parameters that hold a gradient, so ranks that used different
experts would call the collective with different sizes (gloo aborts the process, NCCL hangs or mixes values). Its
public ``set_reduce_scatter_unused_params(True)`` puts a zero-filled gradient in place of a missing one, so every
rank reduces the same buffer and the average counts the rank without a gradient as zero, as DDP does. That alone
differs from DDP in one case: a parameter that no rank used (in no micro-batch since the gradients were last cleared)
would come out with a zero gradient, where DDP and one process leave it None, and AdamW steps a zero gradient (its
moments decay, weight decay applies) but skips a None one. So at the end of each backward that reduces, one
all-reduce of one flag per parameter (``unused_parameter_flags`` in ``comm_stats()``) says which were used anywhere,
and a parameter used nowhere whose gradient was None before this backward gets None back.

When some rank reduced a zero-filled gradient for a parameter another rank used, rank 0 says so once, and every
rank keeps it in ``comm_stats()["implementations"]["unused_parameters"]``: the zero buffer costs memory and reduce-scatter bytes
that a rank using every parameter does not pay.

A whole unit that did not run on some rank still reduces (FSDP2 runs its post-backward at the end of backward), but
after the units that did run there: ranks would then issue the units' reduce-scatters in different orders. Experts
are therefore left inside their block's unit (the default units), not wrapped as units of their own.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import nn

from .._compat import fsdp_param_groups, group_parameters, observe_gradient_reduction, queue_backward_callback
from ..comm.comm_meter import CommMeter
from ..comm.topology import Topology
from .state import fsdp_modules

KIND = "unused_parameter_flags"


class UnusedParameters:
    """Zero gradients for the parameters a rank did not use, and None back for those no rank used (see the module)."""

    def __init__(self, model: nn.Module, topology: Topology, meter: CommMeter) -> None:
        self.topology, self.meter = topology, meter
        self.group = topology.world_mesh.get_group()  # every data-parallel rank, also under hybrid sharding
        self.parameters: list[nn.Parameter] = []
        for module in fsdp_modules(model):
            module.set_reduce_scatter_unused_params(True, recurse=False)
            for group in fsdp_param_groups(module):
                first = len(self.parameters)
                self.parameters.extend(param for param, _ in group_parameters(group))
                observe_gradient_reduction(group, lambda presence, first=first: self._observe(first, presence))
        self.used = [False] * len(self.parameters)  # this rank, this backward
        self.had_grad: dict[int, bool] = {}  # index -> whether its sharded gradient existed before this backward
        self.warned = False

    def _observe(self, first: int, presence: list[bool] | None) -> None:
        if presence is None:  # inside no_sync: the gradients stay local until the backward that reduces them
            return
        if not self.had_grad:
            queue_backward_callback(self._after_reductions)
        for offset, has_grad in enumerate(presence):
            index = first + offset
            self.used[index] = self.used[index] or has_grad
            self.had_grad.setdefault(index, self.parameters[index].grad is not None)

    def _after_reductions(self) -> None:
        flags = torch.tensor(self.used, dtype=torch.int32, device=self.topology.device_type)  # the current device
        dist.all_reduce(flags, group=self.group)
        self.meter.record_allreduce(self.group, flags.numel() * flags.element_size(), "all_reduce int32", kind=KIND)
        users = flags.tolist()
        for index, count in enumerate(users):
            if count == 0 and index in self.had_grad and not self.had_grad[index]:
                self.parameters[index].grad = None  # used by no rank: none, as DDP and one process leave it
        world = dist.get_world_size(self.group)
        partly = sum(1 for count in users if 0 < count < world)  # zero-filled on some rank: the same on every rank
        if partly:
            self.meter.note("unused_parameters", "zero gradients reduced for parameters some ranks did not use while "
                                                 "others did (DDP's find_unused_parameters)")
            if not self.warned and self.topology.rank == 0:
                warnings.warn(f"hf_zeropp: {partly} parameters had a gradient on some ranks and none on others (a "
                              f"mixture of experts routing ranks to different experts); a rank without one reduces "
                              f"zeros for it, as DDP's find_unused_parameters does, at the cost of a zero-filled "
                              f"buffer", stacklevel=2)
            self.warned = True
        self.used = [False] * len(self.parameters)
        self.had_grad = {}


__all__ = ["UnusedParameters"]
