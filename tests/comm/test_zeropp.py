"""ZeRO++ end to end on a GPT-2: all three techniques train like ZeRO-3, cut cross-node bytes as the
paper says, keep hpZ's backward gathers inside the node, and switch on and off between steps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_zeropp.testing.spawn import run_distributed

STEPS = 50
SEQ = 32
ZEROPP = {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True}
# At 3e-3 on 4-sequence batches training sits at the edge of stability: a trajectory nudged by quantization noise
# met a batch its weights fitted badly (loss 7.1 at step 40 of 50 against ZeRO-3's 3.2, on one CPU and not another,
# with the weights used in forward within INT8 error of the fp32 master). At 1e-3 the gap stays about 1 %.
LEARNING_RATE = 1e-3


def _gpt2(vocab: int = 256):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0))


def _text_batch(step: int, per_rank: int = 4) -> torch.Tensor:
    from hf_zeropp.testing.corpus import byte_sequences

    sequences = byte_sequences(200_000, SEQ)
    world, rank = dist.get_world_size(), dist.get_rank()
    picks = torch.randint(0, len(sequences), (per_rank * world,), generator=torch.Generator().manual_seed(step))
    return sequences[picks].view(world, per_rank, SEQ)[rank]


def _mean(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def _train(configs: dict[str, dict], steps: int, micro_batches: int = 1):
    import hf_zeropp

    out = {}
    for name, options in configs.items():
        model = _gpt2()
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**options))
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
        losses, record = [], {}
        for step in range(steps):
            if step == 1:
                hf_zeropp.comm_stats(model, reset=True)
            total = 0.0
            for micro in range(micro_batches):
                ids = _text_batch(step * micro_batches + micro)
                loss = model(input_ids=ids, labels=ids).loss / micro_batches
                if step == 1 and micro == 0:
                    record["gathered_after_forward"] = hf_zeropp.gathered_parameter_bytes(model)
                loss.backward()
                total += _mean(loss)
            if step == 1:
                record["step_stats"] = hf_zeropp.comm_stats(model, reset=True)
                record["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
        record["losses"] = losses
        out[name] = record
    return out


@pytest.fixture(scope="module")
def bf16_runs():
    mixed = {"mixed_precision": "bf16", "reduce_dtype": "bf16"}
    configs = {"zero3": {"stage": 3, **mixed}, "zeropp": {**ZEROPP, **mixed},
               "zeropp_fp16": {**ZEROPP, "mixed_precision": "fp16"}}
    return run_distributed(_train, 4, configs, STEPS, node_size=2)


def test_zeropp_tracks_zero3_loss_over_50_steps(bf16_runs):
    """Stated tolerance: with INT8 weights and INT4 gradients the mean loss of the last 10 steps is within 2 % of
    ZeRO-3's and no step is more than 5 % off (measured: 1.0-1.1 % and 1.3-1.4 %); both learn (last-10 mean at least
    25 % below the first loss)."""
    zero3 = bf16_runs[0]["zero3"]["losses"]
    tail = sum(zero3[-10:]) / 10
    assert tail < 0.75 * zero3[0]
    for name in ("zeropp", "zeropp_fp16"):
        losses = bf16_runs[0][name]["losses"]
        assert abs(sum(losses[-10:]) / 10 - tail) <= 0.02 * tail, (name, sum(losses[-10:]) / 10, tail)
        for step, (a, b) in enumerate(zip(losses, zero3)):
            assert abs(a - b) <= 0.05 * b, (name, step, a, b)


def test_gradients_are_the_mean_not_node_size_times_it(bf16_runs):
    """DeepSpeed's qgZ once divided by the node count only (D x the mean); the gradient norm pins it."""
    zero3, zeropp = bf16_runs[0]["zero3"]["grad_norm"], bf16_runs[0]["zeropp"]["grad_norm"]
    assert abs(zeropp - zero3) <= 0.05 * zero3, (zeropp, zero3)


def test_cross_node_volume_is_a_quarter_of_zero3(bf16_runs):
    """ZeRO++ Table 1 analog at world 4 = 2 nodes x 2: cross-node bytes per step ÷ ZeRO-3's <= 0.27."""
    zero3 = bf16_runs[0]["zero3"]["step_stats"]
    zeropp = bf16_runs[0]["zeropp"]["step_stats"]
    ratio = zeropp["total"]["inter_node"] / zero3["total"]["inter_node"]
    assert ratio <= 0.27, ratio
    assert zeropp["bwd_allgather"]["inter_node"] == 0, "hpZ backward gathers must stay inside the node"
    assert zeropp["bwd_allgather"]["intra_node"] > 0
    assert "grad_reduce_scatter" not in zeropp, "qgZ replaced the reduce-scatter"
    assert "qwZ int8" in " | ".join(zeropp["implementations"]["fwd_allgather"])
    assert "2-hop" in " | ".join(zeropp["implementations"]["qgz_inter"])
    # per collective: forward gather ~ 1/2 (INT8 vs bf16, plus scales), gradients ~ 1/4 of bf16 (INT4)
    forward = zeropp["fwd_allgather"]["inter_node"] / zero3["fwd_allgather"]["inter_node"]
    assert 0.5 <= forward <= 0.53, forward
    for rank_result in bf16_runs:
        stats = rank_result["zeropp"]["step_stats"]
        assert stats["bwd_allgather"]["inter_node"] == 0


def test_hpz_holds_one_node_share_of_the_weights_after_forward(bf16_runs):
    """hpZ's memory cost: 1/k of the bf16 weights per rank between forward and backward (paper Fig. 4) — for the
    blocks; the root unit (tied embedding, positions, final norm) stays gathered whole, as stock FSDP2's root
    does, under ZeRO-3 and ZeRO++ alike."""
    model = _gpt2()
    params = sum(p.numel() for p in model.parameters())
    root = params - sum(p.numel() for p in model.transformer.h.parameters())
    for rank_result in bf16_runs:
        assert rank_result["zero3"]["gathered_after_forward"] == root * 2
        held = rank_result["zeropp"]["gathered_after_forward"]
        expected = (params - root) * 2 / 2 + root * 2  # bf16 bytes: the blocks / k=2, the root whole
        assert abs(held - expected) <= 0.02 * expected, (held, expected)


def _world6_run():
    return _train({"zero3": {"stage": 3}, "zeropp": {**ZEROPP, "gradient_bits": 8}}, 6)


def test_three_nodes_and_shards_not_divisible_by_the_world():
    """World 6 = 3 nodes x 2: 64-wide weights split unevenly, LayerNorms are smaller than world x block size."""
    result = run_distributed(_world6_run, 6, node_size=2)[0]
    for a, b in zip(result["zeropp"]["losses"], result["zero3"]["losses"]):
        assert abs(a - b) <= 0.02 * b, (a, b)
    assert result["zeropp"]["step_stats"]["bwd_allgather"]["inter_node"] == 0


def _schedule_run():
    import hf_zeropp

    model = _gpt2()
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**ZEROPP))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    phases = []
    settings = [None, {"quantized_weights": False, "hpz": False, "quantized_gradients": False},
                {"quantized_gradients": True}, {"quantized_weights": True, "hpz": True}]
    for step, setting in enumerate(settings):
        if setting is not None:
            hf_zeropp.set_techniques(model, **setting)
        hf_zeropp.comm_stats(model, reset=True)
        ids = _text_batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        stats = hf_zeropp.comm_stats(model, reset=True)
        phases.append({"active": hf_zeropp.active_techniques(model),
                       "kinds": sorted(k for k in stats if k not in ("total", "implementations")),
                       "bwd_inter": stats.get("bwd_allgather", {}).get("inter_node", 0),
                       "fwd": " | ".join(stats["implementations"]["fwd_allgather"])})
    with torch.no_grad():  # an evaluation forward leaves hpZ's secondary shards behind; switching drops them
        model(input_ids=_text_batch(0))
    hf_zeropp.set_techniques(model, hpz=False)
    ids = _text_batch(9)
    model(input_ids=ids, labels=ids).loss.backward()
    phases.append({"bwd_inter": hf_zeropp.comm_stats(model, reset=True)["bwd_allgather"]["inter_node"]})
    return phases


def test_techniques_switch_on_and_off_between_steps():
    phases = run_distributed(_schedule_run, 4, node_size=2)[0]
    all_on, all_off, qgz_only, all_again = phases[:4]
    assert all_on["kinds"] == ["bwd_allgather", "fwd_allgather", "qgz_1d_full_precision", "qgz_inter", "qgz_intra",
                               "unused_parameter_flags"]
    assert all_on["bwd_inter"] == 0
    assert all_off["active"] == {"quantized_weights": False, "hpz": False, "quantized_gradients": False}
    assert all_off["kinds"] == ["bwd_allgather", "fwd_allgather", "grad_reduce_scatter", "unused_parameter_flags"]
    assert all_off["bwd_inter"] > 0 and "qwZ" not in all_off["fwd"]
    assert qgz_only["kinds"] == ["bwd_allgather", "fwd_allgather", "qgz_1d_full_precision", "qgz_inter", "qgz_intra",
                                 "unused_parameter_flags"]
    assert all_again["active"] == {"quantized_weights": True, "hpz": True, "quantized_gradients": True}
    assert all_again["bwd_inter"] == 0 and "qwZ" in all_again["fwd"]
    assert phases[4]["bwd_inter"] > 0  # switched off after an evaluation forward: backward crosses nodes again


def _accumulation_run():
    return _train({"zeropp": ZEROPP, "zero3": {"stage": 3}, "hpz": {"stage": 3, "hpz_partition_size": "node"}}, 3,
                  micro_batches=2)


def test_hpz_with_gradient_accumulation_regathers_across_nodes_each_micro_batch():
    """Documented behaviour: after each backward the weights reshard to the world, so every micro-batch's forward
    gathers across nodes again (qwZ-compressed); backward gathers stay inside the node. hpZ alone (fp32, 2 micro-
    batches) trains exactly as ZeRO-3: same losses and gradient norm."""
    runs = run_distributed(_accumulation_run, 4, node_size=2)[0]
    stats = runs["zeropp"]["step_stats"]
    single = run_distributed(_single_step_run, 4, node_size=2)[0]
    assert stats["fwd_allgather"]["inter_node"] == 2 * single["fwd_allgather"]["inter_node"]
    assert stats["bwd_allgather"]["inter_node"] == 0
    hpz, zero3 = runs["hpz"], runs["zero3"]
    assert hpz["step_stats"]["bwd_allgather"]["inter_node"] == 0
    assert hpz["losses"] == pytest.approx(zero3["losses"], rel=1e-6)
    assert hpz["grad_norm"] == pytest.approx(zero3["grad_norm"], rel=1e-6)


def _single_step_run():
    return _train({"zeropp": ZEROPP}, 2)["zeropp"]["step_stats"]


def _one_backward_gradients(unused_parameter: bool):
    """Full gradients of one backward of a tiny GPT-2 under ZeRO-3, qgZ, and qgZ with 1-D parameters in full
    precision; with ``unused_parameter`` block 1 carries a parameter that gets no gradient."""
    import hf_zeropp
    from hf_zeropp.testing.tiny_models import local_batch, tiny_gpt2

    out = {}
    for name, options in {"zero3": {"stage": 3},
                          "qgz": {"stage": 3, "quantized_gradients": True, "gradient_full_precision_1d": False},
                          "qgz_1d": {"stage": 3, "quantized_gradients": True},
                          "qgz_local": {"stage": 3, "quantized_gradients": True,
                                        "gradient_full_precision_local": True}}.items():
        model = tiny_gpt2(n_embd=64)
        if unused_parameter:
            model.transformer.h[1].register_parameter("unused", torch.nn.Parameter(torch.zeros(5)))
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**options))
        ids = local_batch(0, size=24)
        model(input_ids=ids, labels=ids).loss.backward()
        grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = (grads, hf_zeropp.comm_stats(model))
    return out


@pytest.mark.parametrize("world", [4, 6])
def test_full_precision_1d_sends_biases_and_norms_exactly(world):
    """DeepSpeed parity: with ``gradient_full_precision_1d`` (the default) every 1-D parameter's gradient equals ZeRO-3's (fp32
    summation-order noise only), matrices stay INT4-quantized, and the extra bytes are the 1-D shards in fp32.
    World 6 pads 64-element vectors to 66 (11 per rank)."""
    from hf_zeropp.testing.tiny_models import relative_error

    ranks = run_distributed(_one_backward_gradients, world, False, node_size=2)
    exact, _ = ranks[0]["zero3"]
    quantized, _ = ranks[0]["qgz"]
    vectors, stats = ranks[0]["qgz_1d"]
    one_d = [n for n, g in exact.items() if g.dim() == 1]
    assert len(one_d) == 2 + 2 * 8  # ln_f, and per block ln_1 and ln_2 (weight, bias) and 4 linear biases
    for name in one_d:
        assert relative_error(vectors[name], exact[name]) <= 1e-6, name
    # what the option fixes: quantized with the matrices in 256-blocks, ln_2's gradient rounds to zero entirely
    assert relative_error(quantized["transformer.h.0.ln_2.weight"], exact["transformer.h.0.ln_2.weight"]) > 0.9
    for name in exact.keys() - set(one_d):  # matrices: still INT4 (one step's error ~ 20 %)
        assert 0.05 < relative_error(vectors[name], exact[name]) < 0.3, name
    per_rank = sum(-(-exact[n].numel() // world) for n in one_d)
    for rank_result in ranks:
        sent = rank_result["qgz_1d"][1]["qgz_1d_full_precision"]
        assert sent["intra_node"] + sent["inter_node"] == per_rank * 4 * (world - 1), sent
        assert sent["inter_node"] == per_rank * 4 * (world - 2)  # node_size 2: one peer inside the node
        assert rank_result["qgz_1d"][1]["qgz_inter"] == rank_result["qgz"][1]["qgz_inter"]


@pytest.mark.parametrize("world", [4, 6])
def test_full_precision_local_lowers_every_matrix_error_at_the_same_bytes(world):
    """``gradient_full_precision_local`` on a real model at 2 and 3 emulated nodes of 2: each hop among P peers leaves
    one contribution of P unquantized, so the matrices' gradient error falls (to about sqrt(1/2) at 2 x 2), the
    1-D gradients stay exact and every link carries exactly the bytes it did."""
    from hf_zeropp.testing.tiny_models import relative_error

    ranks = run_distributed(_one_backward_gradients, world, False, node_size=2)
    exact, _ = ranks[0]["zero3"]
    plain, _ = ranks[0]["qgz_1d"]
    local, stats = ranks[0]["qgz_local"]
    matrices = [n for n, g in exact.items() if g.dim() > 1]
    for name in exact.keys() - set(matrices):
        assert relative_error(local[name], exact[name]) <= 1e-6, name
    ratios = sorted(relative_error(local[n], exact[n]) / relative_error(plain[n], exact[n]) for n in matrices)
    assert ratios[-1] < 1.0 and 0.5 < ratios[len(ratios) // 2] < 0.9, ratios
    assert "own contributions in fp32" in " ".join(stats["implementations"]["qgz_inter"])
    for rank_result in ranks:
        for kind in ("qgz_intra", "qgz_inter", "qgz_1d_full_precision"):
            assert rank_result["qgz_local"][1][kind] == rank_result["qgz_1d"][1][kind], kind


def test_full_precision_1d_stays_exact_in_a_unit_with_an_unused_parameter():
    """A parameter no rank uses reduces as zeros with its unit (hf_zeropp.engine.unused_parameters), so FSDP2's buffer
    keeps the layout the 1-D split expects: every 1-D gradient stays exact, and the unused parameter ends with none,
    as under stock."""
    from hf_zeropp.testing.tiny_models import relative_error

    result = run_distributed(_one_backward_gradients, 4, True, node_size=2)[0]
    exact, _ = result["zero3"]
    vectors, stats = result["qgz_1d"]
    assert "qgz_1d_fallback" not in stats["implementations"]
    assert "transformer.h.1.unused" not in exact and exact.keys() == vectors.keys()
    for name, grad in exact.items():
        if grad.dim() == 1:
            assert relative_error(vectors[name], exact[name]) <= 1e-6, name


def test_full_precision_1d_warns_once_where_the_layout_is_not_the_expected_one(monkeypatch):
    """Where FSDP2's buffer does not match the unit's parameters, its 1-D parameters are quantized with the matrices:
    a warning says so, once per unit (the meter notes every call)."""
    from hf_zeropp.comm import layout

    monkeypatch.setattr(layout, "parameter_spans", lambda *args: None)
    vectors = layout.VectorSlices(torch.nn.Linear(2, 2), trainable_only=True)
    with pytest.warns(UserWarning, match="Linear: FSDP2's reduce-scatter buffer does not match") as caught:
        assert vectors.positions(8, 4, torch.device("cpu")) is None
        assert vectors.positions(8, 4, torch.device("cpu")) is None
    assert len(caught) == 1


def _qwz_gathered_block(weight_full_precision_1d: bool):
    """One forward of a GPT-2 block at h = 768 with trained-like values (gains 1 +- 0.1, biases N(0, 0.02),
    matrices N(0, 0.02)) under qwZ at 2 nodes x 2: each parameter's relative error as the forward sees it, and the
    forward gather's bytes."""
    import hf_zeropp
    from hf_zeropp.testing.tiny_models import tiny_gpt2

    model = tiny_gpt2(n_embd=768, n_layer=1)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
            elif param.dim() == 1:
                param.copy_(1 + torch.randn(param.shape, generator=generator) * 0.1)
    block = model.transformer.h[0]
    exact = {name: param.detach().clone() for name, param in block.named_parameters()}
    vector_numels = [p.numel() for p in model.parameters() if p.dim() == 1]  # the block's and the final norm's
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(stage=3, quantized_weights=True,
                                                        weight_full_precision_1d=weight_full_precision_1d))
    seen = {}
    block.register_forward_pre_hook(
        lambda module, args: seen.update({n: p.detach().clone() for n, p in module.named_parameters()}))
    hf_zeropp.comm_stats(model, reset=True)
    with torch.no_grad():
        model(input_ids=torch.arange(16).view(1, 16))
    stats = hf_zeropp.comm_stats(model)
    errors = {name: float((seen[name] - value).norm() / value.norm()) for name, value in exact.items()}
    return {"errors": errors, "fwd_inter_node": stats["fwd_allgather"]["inter_node"],
            "fwd": " | ".join(stats["implementations"]["fwd_allgather"]),
            "vector_numels": vector_numels}


def test_qwz_sends_biases_and_norm_gains_in_the_compute_dtype():
    """weight_full_precision_1d (default): the forward computes with exact 1-D parameters; quantized with the
    matrices, biases sharing INT8 blocks with gains of ~1 were 8-14 % off per forward. The extra bytes are exactly
    the 1-D shards in fp32, to each of the 2 peers on the other node."""
    exact_1d = run_distributed(_qwz_gathered_block, 4, True, node_size=2)[0]
    quantized_1d = run_distributed(_qwz_gathered_block, 4, False, node_size=2)[0]
    for name, error in exact_1d["errors"].items():
        if name.endswith(".weight") and not name.startswith("ln"):
            assert error < 0.01, (name, error)  # matrices: INT8
            assert error == pytest.approx(quantized_1d["errors"][name], rel=0.2)
        else:
            assert error == 0.0, (name, error)
    bias_errors = [error for name, error in quantized_1d["errors"].items() if name.endswith(".bias")]
    assert max(bias_errors) > 0.1, quantized_1d["errors"]  # those that share blocks with norm gains
    world, inter_node_peers = 4, 2
    extra = sum(-(-n // world) for n in exact_1d["vector_numels"]) * 4 * inter_node_peers
    assert exact_1d["fwd_inter_node"] - quantized_1d["fwd_inter_node"] == extra
    assert "1-D parameters in torch.float32" in exact_1d["fwd"]
