"""``zeropp: auto``: the link probe, the step-time model that compares ZeRO-3, ZeRO++, hybrid and hybrid-q, and the
choice: the same on every rank, reported in ``comm_stats``, and training exactly as the chosen preset does."""

from __future__ import annotations

import pytest
import torch

from hf_zeropp import ZeroPPConfig
from hf_zeropp.engine.auto import CANDIDATES, MARGIN, Links, pick, step_traffic
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.comm.topology import Topology

SLOW = Links(intra_latency=1e-4, intra_rate=5e9, inter_latency=1e-3, inter_rate=12.5e6,
             quantize_seconds_per_element=1e-9, update_seconds_per_element=1e-9)  # 100 Mbit/s between nodes
# as fast across nodes as inside: quantizing costs, and so does hybrid's larger optimizer step
FAST = Links(intra_latency=1e-4, intra_rate=5e9, inter_latency=1e-4, inter_rate=5e9,
             quantize_seconds_per_element=2e-9, update_seconds_per_element=2e-9)
# fast enough across nodes that hybrid-q's INT4 gradient is predicted less than 10 % faster than INT8
WIDE = Links(intra_latency=1e-4, intra_rate=5e9, inter_latency=1e-5, inter_rate=3e8,
             quantize_seconds_per_element=1e-9, update_seconds_per_element=1e-9)
# the same link as WIDE with dearer quantizing: hybrid-q is the fastest, but hybrid is predicted no slower than INT8
FULL = Links(intra_latency=1e-4, intra_rate=5e9, inter_latency=1e-5, inter_rate=3e8,
             quantize_seconds_per_element=3e-9, update_seconds_per_element=1e-9)


def test_step_traffic_counts_what_the_meter_counts():
    """Bytes per rank and step at 2 nodes x 4, 1M parameters in fp32 (the meter's accounting: a world collective
    sends 1/world of its buffer to each peer; hpZ and hybrid gather over the node; qgZ's second hop and the hybrid
    all-reduce send (nodes - 1) / world of the gradient)."""
    topology = Topology.from_config(ZeroPPConfig(node_size=4), 8)
    p = 1_000_000

    def traffic(name: str):
        return step_traffic(ZeroPPConfig.from_dict(CANDIDATES[name]), topology, p, p, units=3)

    zero3 = traffic("zero3")
    assert zero3.calls == {"world": 9} and zero3.quantized == 0
    assert zero3.sent == pytest.approx({"intra": 12e6 * 3 / 8, "inter": 12e6 * 4 / 8})
    int8, int4 = 1 + 4 / 256, 0.5 + 4 / 256
    sent = traffic("zeropp").sent
    assert sent["inter"] == pytest.approx(p * int8 * 4 / 8 + p * int4 / 8)
    assert sent["intra"] == pytest.approx(p * int8 * 3 / 8 + 4e6 * 3 / 4 + p * int4 * 3 / 4)
    # INT8 gradients: both qgZ hops carry twice the gradient's bytes, the weights' stay
    sent = traffic("zeropp int8 gradients").sent
    assert sent["inter"] == pytest.approx(p * int8 * 4 / 8 + p * int8 / 8)
    assert sent["intra"] == pytest.approx(p * int8 * 3 / 8 + 4e6 * 3 / 4 + p * int8 * 3 / 4)
    hybrid = traffic("hybrid")
    assert hybrid.sent == pytest.approx({"intra": 12e6 * 3 / 4, "inter": 2 * 4e6 / 8})
    hybrid_q = traffic("hybrid-q")
    assert hybrid_q.sent["inter"] == pytest.approx(2 * p * int4 / 8) and hybrid_q.quantized == pytest.approx(3 * p / 4)
    assert traffic("hybrid-q int8").sent["inter"] == pytest.approx(2 * p * int8 / 8)
    # the optimizer step: ZeRO's over 1/world of the parameters, hybrid's over the node's share
    assert zero3.updated == p / 8 and hybrid.updated == hybrid_q.updated == p / 4
    # the ordering the arithmetic gives: hybrid-q sends the fewest bytes across nodes, then ZeRO++
    inter = {name: traffic(name).sent["inter"] for name in CANDIDATES}
    assert inter["hybrid-q"] < inter["hybrid-q int8"] < inter["zeropp"] < inter["hybrid"] < inter["zero3"]


def test_pick_prefers_the_more_accurate_candidate_unless_the_other_is_margin_faster():
    times = {"zero3": 1.0, "zeropp": 0.5, "zeropp int8 gradients": 0.6, "hybrid": 0.9, "hybrid-q": 0.46,
             "hybrid-q int8": 0.5}
    assert pick(times) == "hybrid-q int8", "INT4 0.46 s is not 10 % faster than INT8 0.5 s"
    assert pick({**times, "hybrid-q": 0.44}) == "hybrid-q"
    # full precision where it is predicted no slower than INT8, and only where INT8 would have been taken
    assert pick({**times, "hybrid": 0.5}) == "hybrid" and pick({**times, "hybrid": 0.51}) == "hybrid-q int8"
    assert pick({**times, "hybrid-q": 0.44, "hybrid": 0.45}) == "hybrid-q"
    fastest = {"zero3": 1.0, "zeropp": 1 - MARGIN + 1e-6, "zeropp int8 gradients": 1.0}
    assert pick(fastest) == "zero3", "a candidate less than MARGIN faster does not displace ZeRO-3"
    assert pick({**fastest, "zeropp": 0.5, "zeropp int8 gradients": 0.55}) == "zeropp int8 gradients"
    # hybrid left out (does not fit): only what was predicted is taken
    assert pick({"zero3": 1.0, "zeropp": 0.5, "zeropp int8 gradients": 0.9}) == "zeropp"
    # measured times (the trial's margin), ZeRO-3 ruled out before it was timed
    assert pick({"zeropp": 0.50, "zeropp int8 gradients": 0.51, "hybrid": 0.6}, margin=0.03) == "zeropp int8 gradients"
    assert pick({"zeropp": 0.50, "zeropp int8 gradients": 0.52, "hybrid": 0.6}, margin=0.03) == "zeropp"


def _choose_with(links: Links | None, free_bytes: float | None, node_size: int):
    """Shard a tiny GPT-2 with preset auto, the probe replaced by ``links`` (None: measure) and the free memory by
    ``free_bytes``, without the trial (the prediction alone decides: tests/engine/test_auto_trial.py times the first
    batch); the chosen config, the comm_stats note, and the losses of 3 steps."""
    import os

    import torch.distributed as dist

    from hf_zeropp import comm_stats, shard_model
    from hf_zeropp.comm import hybrid
    from hf_zeropp.engine import auto
    from hf_zeropp.engine.auto_trial import TRIAL_ENV
    from hf_zeropp.testing.tiny_models import make_optimizer, tiny_gpt2, train

    probe, free = auto.probe_links, hybrid._free_bytes_per_rank
    if links is not None:
        auto.probe_links = lambda topology, device: links
    if free_bytes is not None:
        hybrid._free_bytes_per_rank = lambda device, ranks: free_bytes
    os.environ[TRIAL_ENV] = "0"
    try:
        model = shard_model(tiny_gpt2(seed=0), ZeroPPConfig.preset("auto", node_size=node_size))
    finally:
        auto.probe_links, hybrid._free_bytes_per_rank = probe, free
        del os.environ[TRIAL_ENV]
    state = model._zeropp
    config = state.config
    losses = train(model, make_optimizer(model), range(3), size=4 * dist.get_world_size())
    return {"shard_group": config.shard_group, "hybrid_gradient_bits": config.hybrid_gradient_bits,
            "gradient_bits": config.gradient_bits,
            "quantized_weights": config.quantized_weights, "quantized_gradients": config.quantized_gradients,
            "note": comm_stats(model)["implementations"].get("auto"), "losses": losses}


def _preset_losses(preset: str, node_size: int, **overrides):
    import torch.distributed as dist

    from hf_zeropp import shard_model
    from hf_zeropp.testing.tiny_models import make_optimizer, tiny_gpt2, train

    model = shard_model(tiny_gpt2(seed=0), ZeroPPConfig.preset(preset, node_size=node_size, **overrides))
    return train(model, make_optimizer(model), range(3), size=4 * dist.get_world_size())


def _auto_launch():
    return {"slow": _choose_with(SLOW, None, 2), "slow_no_room": _choose_with(SLOW, 1.0, 2),
            "fast": _choose_with(FAST, None, 2), "wide": _choose_with(WIDE, None, 2),
            "full": _choose_with(FULL, None, 2), "hybrid": _preset_losses("hybrid", 2),
            "measured": _choose_with(None, None, 2),
            "one_node": _choose_with(None, None, 4),
            "hybrid-q": _preset_losses("hybrid-q", 2), "zeropp": _preset_losses("zeropp", 2),
            "hybrid-q int8": _preset_losses("hybrid-q", 2, hybrid_gradient_bits=8),
            "zeropp int8": _preset_losses("zeropp", 2, gradient_bits=8),
            "zero3": _preset_losses("zero3", 2)}


@pytest.fixture(scope="module")
def auto_runs():
    return run_distributed(_auto_launch, 4, node_size=2, timeout=600)


def test_auto_picks_hybrid_q_on_a_slow_link_and_zeropp_without_room_for_hybrid(auto_runs):
    """On the tiny model the per-call latency outweighs the gradient's bytes, so without hybrid INT4 gradients are
    predicted less than 10 % faster than INT8 and auto takes ZeRO++ with INT8 gradients."""
    slow, no_room = auto_runs[0]["slow"], auto_runs[0]["slow_no_room"]
    assert (slow["shard_group"], slow["hybrid_gradient_bits"]) == ("node", 4)
    assert slow["note"][0].startswith("auto: hybrid-q (predicted communication, quantization and optimizer step per "
                                      "step: hybrid-q ")
    assert slow["losses"] == auto_runs[0]["hybrid-q"], "auto trains exactly as the preset it chose"
    assert slow["note"][0].endswith("; no trial: ZEROPP_AUTO_TRIAL=0)"), "the prediction decided alone, and says so"
    assert no_room["shard_group"] == "world" and no_room["quantized_weights"] and no_room["quantized_gradients"]
    assert no_room["gradient_bits"] == 8 and no_room["note"][0].startswith("auto: zeropp int8 gradients (")
    assert "hybrid left out: the states do not fit a node" in no_room["note"][0]
    assert no_room["losses"] == auto_runs[0]["zeropp int8"] != auto_runs[0]["zeropp"]


def test_auto_gives_hybrid_q_int8_gradients_on_a_link_where_they_cost_little(auto_runs):
    wide = auto_runs[0]["wide"]
    assert (wide["shard_group"], wide["hybrid_gradient_bits"]) == ("node", 8)
    assert wide["note"][0].startswith("auto: hybrid-q int8 (")
    assert "INT8 gradients: hybrid-q is predicted less than 10% faster" in wide["note"][0]
    assert wide["losses"] == auto_runs[0]["hybrid-q int8"], "auto trains exactly as hybrid-q with INT8 gradients"
    assert wide["losses"] != auto_runs[0]["hybrid-q"]


def test_auto_gives_full_precision_gradients_where_predicted_no_slower_than_int8(auto_runs):
    full = auto_runs[0]["full"]
    assert (full["shard_group"], full["hybrid_gradient_bits"]) == ("node", None)
    assert full["note"][0].startswith("auto: hybrid (predicted communication, quantization and optimizer step per "
                                      "step: hybrid-q ")
    assert ("full-precision gradients: hybrid-q is predicted less than 10% faster than hybrid-q int8, and hybrid no "
            "slower than that") in full["note"][0]
    assert full["losses"] == auto_runs[0]["hybrid"] != auto_runs[0]["hybrid-q int8"]


def test_auto_keeps_zero3_when_links_are_fast_and_on_one_node(auto_runs):
    for case in ("fast", "one_node"):
        chosen = auto_runs[0][case]
        assert chosen["shard_group"] == "world" and not chosen["quantized_weights"], case
        assert chosen["note"][0].startswith("auto: zero3"), case
    assert "a single node" in auto_runs[0]["one_node"]["note"][0]
    assert auto_runs[0]["fast"]["losses"] == auto_runs[0]["zero3"]


def test_the_measured_choice_is_the_same_on_every_rank_and_names_the_links(auto_runs):
    choices = [(r["measured"]["shard_group"], r["measured"]["hybrid_gradient_bits"],
                r["measured"]["quantized_weights"]) for r in auto_runs]
    assert len(set(choices)) == 1
    note = auto_runs[0]["measured"]["note"][0]
    assert all(name in note for name in CANDIDATES) and "MB/s" in note and "ms per call" in note
    assert all(torch.isfinite(torch.tensor(auto_runs[0]["measured"]["losses"])))


def _probe_off():
    import os

    from hf_zeropp import comm_stats, shard_model
    from hf_zeropp.testing.tiny_models import tiny_gpt2

    os.environ["ZEROPP_AUTO_PROBE"] = "0"
    model = shard_model(tiny_gpt2(seed=0), ZeroPPConfig.preset("auto", node_size=1))
    return comm_stats(model)["implementations"]["auto"], model._zeropp.config.shard_group


def test_auto_with_the_probe_off_keeps_zero3_and_says_why():
    note, group = run_distributed(_probe_off, 2, node_size=1)[0]
    assert group == "world" and note == ["auto: zero3 (the link probe is off: ZEROPP_AUTO_PROBE=0)"]
