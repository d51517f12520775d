"""qwZ by weight deltas on a GPT-2, 2 emulated nodes x 2 ranks, in one launch: the losses follow ZeRO-3, the weights
forward uses are nearer the master than INT8 qwZ's at under 0.55 of its cross-node bytes, every rank's copy of a
shard is bit-identical, and each way weights change outside a training step (a load, switching qwZ off and on, a
resumed checkpoint) starts the copy again from a full gather."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hf_zeropp.testing.spawn import run_distributed

SEQ = 32
STEPS = 4
QWZ8 = {"stage": 3, "quantized_weights": True}
DELTAS = {"stage": 3, "quantized_weights": True, "weight_bits": 4, "weight_deltas": True}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _batch(step: int) -> torch.Tensor:
    from hf_zeropp.testing.corpus import byte_sequences

    sequences = byte_sequences(200_000, SEQ)
    world, rank = dist.get_world_size(), dist.get_rank()
    picks = torch.randint(0, len(sequences), (4 * world,), generator=torch.Generator().manual_seed(step))
    return sequences[picks].view(world, 4, SEQ)[rank]


def _copies_agree(model) -> bool:
    """Every rank of a column (equal local index) holds the same copy of every unit, to the bit."""
    from hf_zeropp.engine.state import zeropp_state

    state = zeropp_state(model)
    digest = torch.tensor([float(c.copy.double().sum() + (c.copy.double() ** 2).sum().sqrt())
                           for c in state.all_gathers if c.copy is not None], dtype=torch.float64)
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, digest)
    node_size = state.topology.node_size
    return len(digest) > 0 and all(torch.equal(gathered[r], gathered[r % node_size])
                                   for r in range(dist.get_world_size()))


def _train(options: dict, steps: int, *, micro_batches: int = 1, between=None, frozen_block: bool = False) -> dict:
    """Train ``steps`` AdamW steps; per step the loss, the forward gather's cross-node bytes, its error against the
    master and how it ran. ``between(model, optimizer, step)`` runs before each step; ``frozen_block`` freezes the
    first transformer block."""
    import hf_zeropp
    from hf_zeropp.engine.state import zeropp_state

    model = _gpt2()
    model.transformer.h[0].requires_grad_(not frozen_block)
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig.from_dict({"node_size": 2, **options}))
    zeropp_state(model).meter.track_errors = True
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    record = {"losses": [], "bytes": [], "errors": [], "how": []}
    for step in range(steps):
        if between is not None:
            between(model, optimizer, step)
        hf_zeropp.comm_stats(model, reset=True)
        total = 0.0
        for micro in range(micro_batches):
            ids = _batch(step * micro_batches + micro)
            loss = model(input_ids=ids, labels=ids).loss / micro_batches
            loss.backward()
            total += float(loss.detach())
        stats = hf_zeropp.comm_stats(model)
        optimizer.step()
        optimizer.zero_grad()
        record["losses"].append(total)
        record["bytes"].append(stats["fwd_allgather"]["inter_node"])
        record["bwd_inter"] = stats.get("bwd_allgather", {}).get("inter_node", 0)
        record["errors"].append(stats.get("quantization_error", {}).get("fwd_allgather"))
        record["how"].append(" | ".join(stats["implementations"]["fwd_allgather"]))
    record["copies_agree"] = _copies_agree(model) if options.get("weight_deltas") else None
    record["kept_share"] = (hf_zeropp.gathered_parameter_bytes(model)
                            / sum(p.numel() * p.element_size() for p in _gpt2().parameters()))
    return record


def _changed_outside_the_optimizer(model, optimizer, step):
    """At step 3, load the initial weights scaled by 0.9; at step 5 scale every shard by 0.9 in place."""
    if step == 3:
        model.load_state_dict({name: value * 0.9 for name, value in _gpt2().state_dict().items()})
    if step == 5:
        with torch.no_grad():
            for param in model.parameters():
                param.to_local().mul_(0.9)


def _switch_off_and_on(model, optimizer, step):
    import hf_zeropp

    if step in (2, 4):
        hf_zeropp.set_techniques(model, quantized_weights=step == 4)


def _save_and_resume(directory):
    def between(model, optimizer, step):
        import hf_zeropp

        if step == 2:
            hf_zeropp.save_checkpoint(directory, model, optimizer, step=step)
            hf_zeropp.load_checkpoint(directory, model, optimizer)

    return between


def _runs(directory: str):
    out = {"zero3": _train({"stage": 3}, STEPS), "qwz8": _train(QWZ8, STEPS), "deltas": _train(DELTAS, STEPS),
           "preset": _train({"preset": "zeropp-deltas"}, STEPS), "zeropp": _train({"preset": "zeropp"}, STEPS)}
    hard = {"micro_batches": 2, "frozen_block": True}
    out["zero3_hard"] = _train({"stage": 3, "activation_checkpointing": True}, 3, **hard)
    out["hard"] = _train({**DELTAS, "activation_checkpointing": True, "hpz_partition_size": "node"}, 3,
                         between=_save_and_resume(directory), **hard)
    out["reloaded"] = _train(DELTAS, 6, between=_changed_outside_the_optimizer)
    out["switched"] = _train({**DELTAS, "mixed_precision": "bf16"}, 6, between=_switch_off_and_on)
    return out


def _gap(losses: list[float], reference: list[float]) -> float:
    return sum(abs(a - b) for a, b in zip(losses, reference))


def test_weight_deltas_on_gpt2_2x2(tmp_path):
    runs = run_distributed(_runs, 4, str(tmp_path / "checkpoint"), node_size=2)
    result = runs[0]
    zero3, qwz8, deltas = result["zero3"], result["qwz8"], result["deltas"]
    # the losses stay within 3e-4 of ZeRO-3's at every step, as INT8 qwZ's (measured: summed gaps over the 4 steps
    # 1.5e-3 and 1.1e-3); with qgZ's INT4 gradients the preset is as far from ZeRO-3 as zeropp (1.5e-2 and 1.6e-2)
    for step, (a, b) in enumerate(zip(deltas["losses"], zero3["losses"])):
        assert abs(a - b) <= 1e-3 * b, (step, a, b)
    assert _gap(result["preset"]["losses"], zero3["losses"]) <= 1.2 * _gap(result["zeropp"]["losses"],
                                                                           zero3["losses"])
    assert deltas["errors"][0] == 0.0 and "full" in deltas["how"][0]
    for step in range(1, STEPS):
        assert deltas["errors"][step] <= qwz8["errors"][step], (step, deltas["errors"], qwz8["errors"])
        assert deltas["bytes"][step] <= 0.55 * qwz8["bytes"][step], (step, deltas["bytes"], qwz8["bytes"])
        assert "int4 differences" in deltas["how"][step]
    assert all(rank[name]["copies_agree"] for rank in runs for name in ("deltas", "hard", "reloaded", "switched"))
    assert result["preset"]["bwd_inter"] == 0, "backward's gather must run from the node's copies"
    # between steps a rank keeps 1/node_size of the weights (plus its shards' padding), counted as gathered bytes
    assert 0.5 <= deltas["kept_share"] <= 0.52 and zero3["kept_share"] == 0, (deltas["kept_share"], zero3)
    # accumulation, activation checkpointing, a frozen block and hpZ; resumed in place before step 2
    hard = result["hard"]
    for step, (a, b) in enumerate(zip(hard["losses"], result["zero3_hard"]["losses"])):
        assert abs(a - b) <= 1e-3 * b, (step, a, b)
    assert ["full" in how for how in hard["how"]] == [True, False, True], hard["how"]
    # weights loaded from outside the optimizer: gathered whole, exactly, then differences again
    reloaded = result["reloaded"]
    assert reloaded["bytes"][3] == deltas["bytes"][0] and reloaded["errors"][3] == 0.0
    assert "int4 differences" in reloaded["how"][4] and reloaded["errors"][4] <= min(qwz8["errors"])
    # changed in place: INT4 leaves the shards too far off, so the same gather sends the rest again at INT8
    assert "int8 differences" in reloaded["how"][5] and "lost more than 0.004" in reloaded["how"][5], reloaded
    assert reloaded["errors"][5] <= 4e-3, reloaded
    assert not any("lost more" in how for how in deltas["how"]), "no ordinary step needs a second round"
    # qwZ off at step 2, on again at step 4: plain gathers, then a full one, then differences (bf16 compute)
    switched = result["switched"]
    assert [how.split(":")[0].split(" ")[0] for how in switched["how"]] == ["weight", "weight", "all_gather",
                                                                             "all_gather", "weight", "weight"]
    assert "full" in switched["how"][4] and "int4 differences" in switched["how"][5]
