"""The inter-node hop's per-block widths, chosen by each rule of WIDTH_RULES on one quantization of the exact
shard."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_zeropp.kernels.allocation import block_widths, round_trip_with_widths
from hf_zeropp.kernels.reference import hadamard_rows, num_blocks

from .candidates import RULE_BITS, RULE_HADAMARD, RULE_HISTORY_DECAY, WIDTH_RULES
from .measures import AdamNormalizer, Sums

if TYPE_CHECKING:
    from .probes import Probe


class WidthRules:
    """The width-rule table: one inter-node quantization of the exact reduced shard under each of WIDTH_RULES (see
    the package docstring), plain and Adam-normalized. The history rule's moving average runs over every step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.history: dict[int, list] = {}  # unit -> [moving average of each block's squared absmax, updates]
        self.sums = Sums(len(WIDTH_RULES))
        self.scaled_sums = Sums(len(WIDTH_RULES))

    def observe(self, unit: int, exact: torch.Tensor, positions: list[torch.Tensor]):
        """This step's rotated row (1-D slices zeroed, zero-padded to whole blocks) and the history rule's keys,
        after folding this step's block scales into the moving average."""
        row = torch.zeros(num_blocks(exact.numel(), self.block_size) * self.block_size)
        kept = torch.cat(positions[:2])
        row[kept] = exact[kept].float()
        rotated = hadamard_rows(row[None], RULE_HADAMARD)
        absmax = rotated.view(1, -1, self.block_size).abs().amax(-1)
        average = self.history.setdefault(unit, [torch.zeros_like(absmax), 0])
        average[0].mul_(RULE_HISTORY_DECAY).add_(absmax.pow(2), alpha=1 - RULE_HISTORY_DECAY)
        average[1] += 1
        typical = (average[0] / (1 - RULE_HISTORY_DECAY ** average[1])).sqrt()
        return rotated, torch.where(absmax > 0, absmax / typical.clamp_min(1e-30), torch.zeros_like(absmax))

    def measure(self, probe: Probe, positions: list[torch.Tensor], exact: torch.Tensor, rotated: torch.Tensor,
                history_key: torch.Tensor, normalize: AdamNormalizer, second_moment: torch.Tensor) -> None:
        length = rotated.shape[-1]
        absmax = rotated.view(1, -1, self.block_size).abs().amax(-1)
        second = torch.zeros(length, dtype=torch.float32)
        second[:second_moment.numel()] = second_moment.float()
        typical = second.view(1, -1, self.block_size).mean(-1).sqrt()  # the block's RMS gradient, as Adam knows it
        oracle_key = torch.where(absmax > 0, absmax / typical.clamp_min(1e-30), torch.zeros_like(absmax))
        normalized_exact = normalize(exact)
        rules = ((None, 0), (absmax, 0), (absmax, RULE_BITS), (absmax, 2), (history_key, 0), (oracle_key, 0))
        for r, (key, floor) in enumerate(rules):
            widths = (torch.full(absmax.shape, RULE_BITS, dtype=torch.int64) if key is None
                      else block_widths(key, length, RULE_BITS, self.block_size, floor))
            result = hadamard_rows(round_trip_with_widths(rotated, widths, self.block_size), RULE_HADAMARD)
            result = result[0, :exact.numel()].double()
            probe.classify(self.sums, r, positions[:2], result, exact)
            probe.classify(self.scaled_sums, r, positions[:2], normalize(result), normalized_exact)


