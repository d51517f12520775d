"""hybrid-q sends an untied input embedding's gradient across nodes only in the rows where some node holds a
gradient.

Each case is checked against the exact mean gradient of the global batch, computed on one process. The codes are
INT8 (about 0.5 % error), so rows lost or counted twice would show far above the codes' error. Cases: an untied
GPT-2, accumulation over a micro-batch that does not sync, a model that uses the embedding weight beyond its lookups
(every row then holds a gradient), error feedback (rows sent whole), and a tied GPT-2 (the head's dense gradient
shares the weight: sent whole)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_zeropp import ZeroPPConfig
from hf_zeropp.testing.spawn import run_distributed

VOCAB = 1024
LOOKED_UP = 64  # token ids are drawn below this: the lookups touch 1/16 of the rows
INT8 = {"hybrid_gradient_bits": 8}
# case: (tied, embedding used beyond its lookups, micro-batches, hybrid-q options)
CASES = {
    "untied": (False, False, 1, INT8),
    "untied, accumulated without sync": (False, False, 2, INT8),
    "untied, weight used beyond the lookups": (False, True, 1, INT8),
    "untied, error feedback": (False, False, 1, {**INT8, "gradient_error_feedback": True}),
    "tied": (True, False, 1, INT8),
}


def _model(tie: bool, dense_use: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                       tie_word_embeddings=tie))
    if dense_use:  # every row of the weight gets a gradient, not only the looked-up ones
        model.transformer.wte.register_forward_hook(lambda module, args, output: output + module.weight.mean(dim=0))
    return model


def _ids(micro: int, rank: int | None = None) -> torch.Tensor:
    """Micro-batch ``micro`` of the global batch (4 sequences per rank), or ``rank``'s slice of it."""
    world = dist.get_world_size()
    ids = torch.randint(0, LOOKED_UP, (4 * world, 16), generator=torch.Generator().manual_seed(7 + micro))
    return ids if rank is None else ids[4 * rank:4 * rank + 4]


def _exact(tie: bool, dense_use: bool, micro_batches: int) -> dict[str, torch.Tensor]:
    model = _model(tie, dense_use)
    for micro in range(micro_batches):
        ids = _ids(micro)
        (model(input_ids=ids, labels=ids).loss / micro_batches).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _routed(tie: bool, dense_use: bool, micro_batches: int, options: dict):
    from hf_zeropp import comm_stats, shard_model

    model = shard_model(_model(tie, dense_use), ZeroPPConfig.preset("hybrid-q", node_size=2, **options))
    for micro in range(micro_batches):
        model.set_requires_gradient_sync(micro == micro_batches - 1)
        ids = _ids(micro, dist.get_rank())
        (model(input_ids=ids, labels=ids).loss / micro_batches).backward()
    stats = comm_stats(model)
    return {"grads": {name: p.grad.full_tensor() for name, p in model.named_parameters()},
            "local": {name: p.grad.to_local() for name, p in model.named_parameters()},
            "implementations": stats["implementations"],
            "cross": stats["hybrid_reduce_scatter"]["inter_node"] + stats["hybrid_all_gather"]["inter_node"],
            "row_mask": stats.get("hybrid_row_mask", {}).get("inter_node", 0)}


def _launch():
    exact = {case: _exact(*CASES[case][:3]) for case in CASES} if dist.get_rank() == 0 else None
    return {"exact": exact, **{case: _routed(*CASES[case]) for case in CASES}}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_launch, 4, node_size=2, timeout=600)


def _relative_error(got: dict, exact: dict, names) -> float:
    names = list(names)
    return (sum(float((got[n] - exact[n]).pow(2).sum()) for n in names)
            / sum(float(exact[n].pow(2).sum()) for n in names)) ** 0.5


@pytest.mark.parametrize("case", list(CASES))
def test_the_gradient_is_the_mean_over_all_ranks_and_replicas_get_the_same_bits(results, case):
    exact, got = results[0]["exact"][case], results[0][case]["grads"]
    error = _relative_error(got, exact, exact)
    embedding = _relative_error(got, exact, ["transformer.wte.weight"])
    looked_up = (got["transformer.wte.weight"][:LOOKED_UP] - exact["transformer.wte.weight"][:LOOKED_UP]).norm() / \
        exact["transformer.wte.weight"][:LOOKED_UP].norm()
    print(f"{case}: gradient error {error:.4f}, input embedding {embedding:.4f}, its looked-up rows {looked_up:.4f}")
    assert error < 0.02 and embedding < 0.02 and looked_up < 0.02, (error, embedding, looked_up)
    for rank in (2, 3):
        mine, replica = results[rank][case]["local"], results[rank - 2][case]["local"]
        assert all(torch.equal(mine[name], replica[name]) for name in mine), rank


def test_each_case_says_how_the_embedding_gradient_crossed_nodes(results):
    def said(case: str) -> tuple[str, list[str]]:
        implementations = results[0][case]["implementations"]
        return implementations["hybrid_reduce_scatter"][0], implementations.get("hybrid_embedding_rows", [])

    for case in ("untied", "untied, accumulated without sync"):
        description, notes = said(case)
        assert description.endswith("full precision, input-embedding rows that hold a gradient") and notes == []
    assert said("untied, weight used beyond the lookups")[1] == [
        "the input embedding's gradient crossed nodes whole: most of its rows hold a gradient"]
    description, notes = said("untied, error feedback")
    assert "input-embedding rows" not in description
    assert notes == ["the input embedding's gradient crosses nodes whole: error feedback keeps a residual for every "
                     "position"]
    description, notes = said("tied")
    assert "input-embedding rows" not in description and notes == []
    assert results[0]["tied"]["row_mask"] == 0 < results[0]["untied"]["row_mask"]


def test_only_rows_that_hold_a_gradient_cross_nodes(results):
    """Untied, the input embedding is a unit of its own; its 1024 rows cross nodes whole with error feedback and
    only the 64 looked-up ones without (blocks of 256 padded per node)."""
    sparse, whole = results[0]["untied"]["cross"], results[0]["untied, error feedback"]["cross"]
    embedding_bytes = VOCAB * 32 // 2 * (1 + 4 / 256)  # this rank's half of the rows, as INT8 codes and scales
    print(f"cross-node bytes: rows that hold a gradient {sparse}, whole {whole}")
    assert whole - sparse > 0.8 * embedding_bytes, (whole, sparse, embedding_bytes)
