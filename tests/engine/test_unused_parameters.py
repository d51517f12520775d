"""Experts that get a gradient on one rank and none on another (:mod:`hf_zeropp.engine.unused_parameters`): in one
2-rank launch, a hand-built mixture of experts whose ranks route to different experts trains at stages 0-3, with
gradient accumulation, hybrid sharding and qgZ, equal to one process on the concatenated batch (fp32, 1e-5) — an
expert no rank uses keeps no gradient, as stock gives it — and a real tiny Switch Transformers trains as stock DDP
with ``find_unused_parameters=True``."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import full_parameters, make_optimizer, relative_error

EXACT, STEPS, MICRO, WIDTH, EXPERTS = 1e-5, 2, 2, 8, 4
# token id -> expert: (id % 8) // 2, so ids 0-1 use expert 0, 2-3 expert 1, 4-5 expert 2, 6-7 expert 3
RANK_TOKENS = {0: [0, 1, 2, 3], 1: [0, 1, 4, 5]}  # expert 0 everywhere, 1 on rank 0 only, 2 on rank 1 only, 3 never
RUNS = {
    "stage0": {"stage": 0}, "stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3},
    "hybrid": {"stage": 3, "shard_group": "node"},  # 2 nodes of 1 rank: sharded in the node, all-reduced across
    "qgz": {"stage": 3, "quantized_gradients": True, "gradient_bits": 8},
}


class MoEBlock(nn.Module):
    """A residual layer of experts, each token sent to the expert its id names and scaled by a learned gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, 1)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))

    def forward(self, hidden: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for index, expert in enumerate(self.experts):
            chosen = route == index
            if chosen.any():  # an expert no token of this rank chose does not run: its weights get no gradient
                out = out.index_put((chosen,), expert(hidden[chosen]) * torch.sigmoid(self.gate(hidden[chosen])))
        return hidden + out


class TinyMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(3))
        self.head = nn.Linear(WIDTH, 16)

    def forward(self, ids: torch.Tensor, skip_last_block: bool = False) -> torch.Tensor:
        """The mean cross-entropy of predicting each id from itself; the last block runs in step 0 only."""
        hidden, route = self.embed(ids), (ids % 8) // 2
        for block in self.blocks[:-1] if skip_last_block else self.blocks:
            hidden = block(hidden, route)
        return nn.functional.cross_entropy(self.head(hidden), ids)


def _ids(rank: int, step: int, micro: int) -> torch.Tensor:
    """Rank ``rank``'s tokens: micro-batch 0 routes to both of its experts, micro-batch 1 to expert 0 only."""
    tokens = torch.tensor(RANK_TOKENS[rank] if micro == 0 else RANK_TOKENS[rank][:2])
    return tokens[torch.randint(0, len(tokens), (6,), generator=torch.Generator().manual_seed(10 * step + rank))]


def _train(model, optimizer, ranks: list[int], accumulate=contextlib.nullcontext) -> list[float]:
    losses = []
    for step in range(STEPS):
        total = 0.0
        for micro in range(MICRO):
            ids = torch.cat([_ids(rank, step, micro) for rank in ranks])
            with accumulate() if micro < MICRO - 1 else contextlib.nullcontext():
                loss = model(ids, skip_last_block=step > 0) / MICRO
                loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def _one_process() -> dict:
    model = TinyMoE()
    optimizer = make_optimizer(model)
    losses = _train(model, optimizer, [0, 1])
    return {"losses": losses, "weights": full_parameters(model), "state": _has_state(model, optimizer)}


def _has_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, bool]:
    """Whether AdamW stepped each parameter (a None gradient is skipped, a zero one is not)."""
    return {name: bool(optimizer.state.get(param)) for name, param in model.named_parameters()}


def _every_run() -> dict:
    import hf_zeropp

    out = {}
    for name, values in RUNS.items():
        model = hf_zeropp.shard_model(TinyMoE(), {**values, "wrap_modules": ["MoEBlock"]})
        optimizer = make_optimizer(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = _train(model, optimizer, [dist.get_rank()], lambda: hf_zeropp.no_sync(model))
        out[name] = {"losses": [_mean(loss) for loss in losses], "weights": full_parameters(model),
                     "state": _has_state(model, optimizer),
                     "implementations": hf_zeropp.comm_stats(model)["implementations"],
                     "warnings": [str(w.message) for w in caught if "had a gradient on some ranks" in str(w.message)]}
    return out


def _mean(value: float) -> float:
    tensor = torch.tensor(value)
    dist.all_reduce(tensor)
    return float(tensor) / dist.get_world_size()


@pytest.fixture(scope="module")
def runs() -> tuple[dict, dict]:
    return _one_process(), run_distributed(_every_run, 2, node_size=1)[0]


@pytest.mark.parametrize("name", [name for name in RUNS if name != "qgz"])
def test_ranks_routing_to_different_experts_train_as_one_process(runs, name):
    reference, results = runs
    got = results[name]
    assert got["losses"] == pytest.approx(reference["losses"], rel=EXACT)
    for key, expected in reference["weights"].items():
        assert relative_error(got["weights"][key], expected) <= EXACT, (name, key)
    assert got["state"] == reference["state"], name  # expert 3 and, after step 0, nothing else is skipped
    assert not reference["state"]["blocks.0.experts.3.weight"] and reference["state"]["blocks.0.experts.2.weight"]
    assert "DDP's find_unused_parameters" in got["implementations"]["unused_parameters"][0]
    # rank 0 says it once: each block's experts 1 and 2, in micro-batch 0 of step 0 (stages 2-3) or at its end
    assert len(got["warnings"]) == 1 and got["warnings"][0].startswith("hf_zeropp: 12 parameters"), got["warnings"]


def test_qgz_reduces_the_zero_filled_experts_too(runs):
    reference, results = runs
    got = results["qgz"]
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-2)
    assert got["state"] == reference["state"]
