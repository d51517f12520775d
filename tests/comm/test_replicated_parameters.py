"""Parameters FSDP2 cannot shard (0-d: Accelerate's RegressionModel ``a``/``b``, CLIP's ``logit_scale``) are kept
replicated and trained as DDP trains them (:mod:`hf_zeropp.comm.replicated`): every preset against one process training
on the same global batch (the loss the mean of the ranks' losses, as DDP averages gradients), fp32; their all-reduce in
``comm_stats``; rank 0's values at sharding time; and every checkpoint format round-tripping them. A tiny SigLIP (its
``logit_scale``/``logit_bias`` are 1-element vectors, which FSDP2 shards unevenly: one rank holds nothing) trains
beside them."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import full_parameters, relative_error

KINDS = ("regression", "clip", "siglip")
SCALARS = {"regression": ("a", "b"), "clip": ("logit_scale",), "siglip": ("logit_scale", "logit_bias")}
STEPS, MICRO, LR, CLIP_AT = 3, 2, 1e-2, 1.0
EXACT_MODES = {"ddp": 2, "zero1": 2, "zero2": 2, "zero3": 2, "hybrid": 4}  # mode -> world (4: 2 nodes x 2)
QUANTIZED_MODES = {"zeropp": 4, "hybrid-q": 4}
NODE_SIZE = 2
EXACT = 1e-6
# ZeRO++ (INT8 weights, INT4 gradients) and hybrid-q (INT4 cross-node gradients) against stock, relative: each step's
# loss as tests/comm/test_zeropp.py allows (5 %), the whole model's weights as tests/conformance/test_conformance.py
# (15 %), and each replicated parameter's movement from its initial value as the weights (its gradient comes from
# quantized activations)
QUANTIZED = {"loss": 0.05, "weights": 0.15}


def _build(kind: str, rank: int = 0):
    """The model, seeded; rank 0's values are the reference's (the others' ``a`` differs: sharding gives every rank
    rank 0's)."""
    torch.manual_seed(0)
    if kind == "regression":
        from accelerate.test_utils.training import RegressionModel

        model = RegressionModel(a=1.0 + rank, b=-0.5)
        model.first_batch = False  # its first forward prints the dtypes
        return model
    from transformers import CLIPConfig, CLIPModel, SiglipConfig, SiglipModel

    tokens = dict(vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                max_position_embeddings=8, **tokens)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                  patch_size=4)
    if kind == "clip":
        return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    return SiglipModel(SiglipConfig(text_config=text, vision_config=vision))


def _batch(kind: str, step: int, micro: int, rank: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + 100 * step + 10 * micro + rank)
    if kind == "regression":
        x = torch.randn(4, generator=generator)
        return {"x": x, "y": 2 * x + 3 + 0.1 * torch.randn(4, generator=generator)}
    return {"input_ids": torch.randint(2, 64, (3, 8), generator=generator),
            "pixel_values": torch.randn(3, 3, 8, 8, generator=generator)}


def _loss(kind: str, model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if kind == "regression":
        return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
    return model(**batch, return_loss=True).loss


def _scalars(kind: str, model) -> list[float]:
    from torch.distributed.tensor import DTensor

    params = dict(model.named_parameters())
    return [float((p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(()))
            for p in (params[name] for name in SCALARS[kind])]


def _optimizer(model) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-6, weight_decay=0.01)


def _reference(kind: str, world: int) -> dict:
    """Stock: one process, each micro-batch's loss the mean of the ranks' losses (DDP's averaged gradient), torch's
    own clip_grad_norm_ and AdamW."""
    model = _build(kind)
    optimizer = _optimizer(model)
    record = {"loss": [], "grad_norm": [], "scalars": []}
    for step in range(STEPS):
        for micro in range(MICRO):
            loss = torch.stack([_loss(kind, model, _batch(kind, step, micro, r)) for r in range(world)]).mean()
            (loss / MICRO).backward()
        record["grad_norm"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_AT)))
        optimizer.step()
        optimizer.zero_grad()
        record["loss"].append(float(loss.detach()))
        record["scalars"].append(_scalars(kind, model))
    record["weights"] = full_parameters(model)
    return record


def _sharded(kind: str, mode: str):
    import hf_zeropp

    model = _build(kind, dist.get_rank())
    return hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig.preset(mode, node_size=NODE_SIZE))


def _train_ranks(mode: str) -> dict:
    """Every kind under ``mode``: accumulation through no_sync, hf_zeropp's clip_grad_norm_, AdamW."""
    import hf_zeropp
    from hf_zeropp.engine.runtime import clip_grad_norm_

    out = {}
    for kind in KINDS:
        model = _sharded(kind, mode)
        optimizer = _optimizer(model)
        record = {"loss": [], "grad_norm": [], "scalars": []}
        for step in range(STEPS):
            for micro in range(MICRO):
                last = micro == MICRO - 1
                with contextlib.nullcontext() if last else hf_zeropp.no_sync(model):
                    loss = _loss(kind, model, _batch(kind, step, micro, dist.get_rank()))
                    (loss / MICRO).backward()
            record["grad_norm"].append(float(clip_grad_norm_(model.parameters(), CLIP_AT)))
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            record["loss"].append(float(mean) / dist.get_world_size())
            record["scalars"].append(_scalars(kind, model))
        record["weights"] = full_parameters(model)
        record["stats"] = hf_zeropp.comm_stats(model)
        out[kind] = record
    return out


@pytest.fixture(scope="module")
def references() -> dict:
    return {(kind, world): _reference(kind, world) for kind in KINDS for world in {2, 4}}


class _Runs(dict):
    def __missing__(self, mode: str) -> list[dict]:
        world = {**EXACT_MODES, **QUANTIZED_MODES}[mode]
        self[mode] = result = run_distributed(_train_ranks, world, mode, node_size=NODE_SIZE)
        return result


@pytest.fixture(scope="module")
def runs() -> _Runs:
    return _Runs()


def _close(actual: list[float], expected: list[float], rel: float) -> bool:
    return len(actual) == len(expected) and all(abs(a - e) <= rel * abs(e) for a, e in zip(actual, expected))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", EXACT_MODES)
def test_trains_as_stock(runs, references, mode, kind):
    ours, stock = runs[mode][0][kind], references[(kind, EXACT_MODES[mode])]
    assert stock["loss"][-1] < stock["loss"][0]  # it trains
    assert _close(ours["loss"], stock["loss"], EXACT), (ours["loss"], stock["loss"])
    assert _close(ours["grad_norm"], stock["grad_norm"], EXACT), (ours["grad_norm"], stock["grad_norm"])
    for got, expected in zip(ours["scalars"], stock["scalars"]):
        assert _close(got, expected, EXACT), (ours["scalars"], stock["scalars"])
    assert stock["scalars"][-1] != stock["scalars"][0]  # the 0-d parameters moved
    # the whole model, L2: 1e-5 as tests/engine/test_engine.py (Adam turns reduction-order noise in near-zero gradients,
    # k_proj's bias has only those, into whole updates: 3e-6 measured at this lr)
    assert relative_error(*_flat(ours["weights"], stock["weights"])) <= 1e-5


def _flat(ours: dict[str, torch.Tensor], stock: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    names = sorted(stock)
    assert sorted(ours) == names
    return torch.cat([ours[n].reshape(-1) for n in names]), torch.cat([stock[n].reshape(-1) for n in names])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", QUANTIZED_MODES)
def test_quantized_presets_train_as_stock_within_quantization_noise(runs, references, mode, kind):
    ours, stock = runs[mode][0][kind], references[(kind, QUANTIZED_MODES[mode])]
    assert _close(ours["loss"], stock["loss"], QUANTIZED["loss"]), (ours["loss"], stock["loss"])
    if kind == "regression":  # nothing is sharded, so nothing is quantized: exact
        for got, expected in zip(ours["scalars"], stock["scalars"]):
            assert _close(got, expected, EXACT), (ours["scalars"], stock["scalars"])
    initial = _scalars(kind, _build(kind))
    for got, expected in zip(ours["scalars"], stock["scalars"]):
        moved = [value - start for value, start in zip(got, initial)]
        assert _close(moved, [value - start for value, start in zip(expected, initial)], QUANTIZED["weights"]), (
            ours["scalars"], stock["scalars"], initial)
    assert relative_error(*_flat(ours["weights"], stock["weights"])) <= QUANTIZED["weights"]


@pytest.mark.parametrize("mode", [*EXACT_MODES, *QUANTIZED_MODES])
def test_comm_stats_count_the_all_reduce_and_name_the_parameters(runs, mode):
    from hf_zeropp.comm.replicated import KIND

    world = {**EXACT_MODES, **QUANTIZED_MODES}[mode]
    for rank_result in runs[mode]:
        for kind, names in (("regression", ("a", "b")), ("clip", ("logit_scale",))):
            stats = rank_result[kind]["stats"]
            record = stats["implementations"]["replicated_parameters"]
            assert record[0].startswith(f"{len(names)} parameter{'s' * (len(names) > 1)} FSDP2 cannot shard"), record
            assert all(f"{name} (0-d)" in record[0] for name in names), record
            # a backward per micro-batch at stages 2-3; stages 0-1 skip it inside no_sync
            calls = STEPS * (1 if mode in ("ddp", "zero1") else MICRO)
            assert stats[KIND]["calls"] == calls, stats[KIND]
            # fp32 values and one has-a-gradient flag per parameter; an all-reduce counts 2 / g of the buffer per
            # peer: 1 peer on this rank's node (2 ranks per node), the others on the other node
            buffer = 4 * 2 * len(names)
            assert stats[KIND]["intra_node"] == calls * 2 * buffer * 1 // world, stats[KIND]
            assert stats[KIND]["inter_node"] == calls * 2 * buffer * (world - 2) // world, stats[KIND]
        assert "replicated_parameters" not in rank_result["siglip"]["stats"]["implementations"]
        # nothing of RegressionModel is sharded: no advice to split it into units
        assert "fsdp_units" not in rank_result["regression"]["stats"]["implementations"]


# ---------------------------------------------------------------- checkpoints and placements


def _moments(kind: str, model, optimizer) -> list[list[float]]:
    """AdamW's exp_avg and exp_avg_sq of the replicated parameters."""
    params = dict(model.named_parameters())
    return [[float(optimizer.state[params[name]][key]) for key in ("exp_avg", "exp_avg_sq")]
            for name in SCALARS[kind]]


def _trained(kind: str, mode: str):
    """The sharded model and its optimizer after two steps."""
    model = _sharded(kind, mode)
    optimizer = _optimizer(model)
    for step in range(2):
        _loss(kind, model, _batch(kind, step, 0, dist.get_rank())).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _fresh(kind: str, mode: str):
    """A sharded model at its initial values (other than the trained ones) and an optimizer with no state."""
    model = _sharded(kind, mode)
    return model, _optimizer(model)


def _checkpoints(mode: str, workdir: str) -> dict:
    """Every format's save and load on the trained models: the replicated values (and AdamW's moments where the
    format holds them) as each load restores them, next to the trained ones."""
    from pathlib import Path

    from transformers import CLIPModel

    import hf_zeropp
    from hf_zeropp.checkpoint.deepspeed_convert import convert_deepspeed_checkpoint, export_deepspeed_universal
    from hf_zeropp.checkpoint.deepspeed_restore import load_deepspeed_checkpoint
    from hf_zeropp.engine.full_state import consolidated_state_dict
    from hf_zeropp.engine.materialize import attach_checkpoint

    rank, out = dist.get_rank(), {}
    for kind in ("regression", "clip"):
        folder = Path(workdir) / mode / kind
        model, optimizer = _trained(kind, mode)
        record = out[kind] = {"initial": _scalars(kind, _build(kind)), "trained": _scalars(kind, model),
                              "trained_moments": _moments(kind, model, optimizer)}

        hf_zeropp.save_checkpoint(folder / "dcp", model, optimizer, step=2)  # sharded (DCP)
        fresh, fresh_optimizer = _fresh(kind, mode)
        hf_zeropp.load_checkpoint(folder / "dcp", fresh, fresh_optimizer)
        record["dcp"] = _scalars(kind, fresh), _moments(kind, fresh, fresh_optimizer)

        export_deepspeed_universal(folder / "dcp", folder / "deepspeed")  # DeepSpeed universal, and back
        fresh, fresh_optimizer = _fresh(kind, mode)
        load_deepspeed_checkpoint(folder / "deepspeed", fresh, fresh_optimizer)
        record["deepspeed"] = _scalars(kind, fresh), _moments(kind, fresh, fresh_optimizer)
        convert_deepspeed_checkpoint(folder / "deepspeed", folder / "from_deepspeed")
        fresh, fresh_optimizer = _fresh(kind, mode)
        hf_zeropp.load_checkpoint(folder / "from_deepspeed", fresh, fresh_optimizer)
        record["from_deepspeed"] = _scalars(kind, fresh), _moments(kind, fresh, fresh_optimizer)

        full = consolidated_state_dict(model)  # get_state_dict: rank 0 holds it; every rank loads full tensors
        shared = [full]
        dist.broadcast_object_list(shared, src=0)
        record["full_state_dict"] = [float(shared[0][name]) for name in SCALARS[kind]]
        fresh, _ = _fresh(kind, mode)
        fresh.load_state_dict(shared[0])
        record["load_state_dict"] = _scalars(kind, fresh)

        hf_zeropp.save_pretrained(model, folder / "pretrained")  # per-rank safetensors (CLIP), or rank 0's file
        if kind == "clip":  # each rank reads its slices of those files into a model built on the meta device
            with torch.device("meta"):
                empty = _build(kind)
            attach_checkpoint(empty, folder / "pretrained")  # what from_pretrained attaches
            record["read_in_slices"] = _scalars(kind, hf_zeropp.shard_model(empty, mode))
        if kind == "clip" and rank == 0:
            plain = CLIPModel.from_pretrained(folder / "pretrained")  # plain transformers, no hf_zeropp
            record["pretrained"] = _scalars(kind, plain)
        elif rank == 0:
            saved = torch.load(folder / "pretrained" / "pytorch_model.bin", weights_only=True)
            record["pretrained"] = [float(saved[name]) for name in SCALARS[kind]]
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[dict]:
    return run_distributed(_checkpoints, 2, "zero3", str(tmp_path_factory.mktemp("checkpoints")))


@pytest.mark.parametrize("kind", ["regression", "clip"])
@pytest.mark.parametrize("path", ["dcp", "deepspeed", "from_deepspeed"])
def test_sharded_and_deepspeed_checkpoints_restore_values_and_moments(checkpoints, kind, path):
    for record in (rank_result[kind] for rank_result in checkpoints):
        assert record["trained"] != record["initial"]
        values, moments = record[path]
        assert values == record["trained"], (path, values, record["trained"])
        assert moments == record["trained_moments"], (path, moments, record["trained_moments"])


@pytest.mark.parametrize("kind", ["regression", "clip"])
def test_full_state_dict_and_pretrained_files_hold_them(checkpoints, kind):
    trained = checkpoints[0][kind]["trained"]
    assert checkpoints[0][kind]["full_state_dict"] == trained
    assert checkpoints[0][kind]["pretrained"] == trained
    for rank_result in checkpoints:
        assert rank_result[kind]["load_state_dict"] == trained
        if kind == "clip":
            assert rank_result[kind]["read_in_slices"] == trained


class _ScaledLinear(torch.nn.Module):
    """A layer with a 0-d parameter its own ``reset_parameters`` sets (torch's init convention)."""

    INIT = 0.25

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale = torch.nn.Parameter(torch.empty(()))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.constant_(self.scale, self.INIT)

    def forward(self, x: torch.Tensor, scaled: bool = True) -> torch.Tensor:
        return self.linear(x) * self.scale if scaled else self.linear(x)


def _placements() -> dict:
    """Sharding from rank 0's weights (the others on the meta device), and from the meta device on every rank (the
    model's own init): the replicated values each rank ends with."""
    import hf_zeropp

    out = {}
    for kind in ("regression", "clip"):
        with torch.device("meta") if dist.get_rank() else contextlib.nullcontext():
            model = _build(kind, dist.get_rank())
        out[f"rank0-{kind}"] = _scalars(kind, hf_zeropp.shard_model(model, "zero3"))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = _ScaledLinear()
    out["meta-init"] = float(hf_zeropp.shard_model(model, "zero3").scale)
    with torch.device("meta"):
        model = _build("clip")  # only CLIPModel's constructor sets logit_scale, from the config; no init does
    with pytest.raises(RuntimeError) as refused:
        hf_zeropp.shard_model(model, "zero3")
    out["meta-clip"] = str(refused.value)
    return out


def test_every_rank_starts_from_rank_0s_values():
    """Rank 0 real and the others on the meta device: rank 0's values everywhere (the others' ``a`` differs in
    _build); on the meta device everywhere: the model's init (``reset_parameters``), or an error naming what no init
    sets."""
    results = run_distributed(_placements, 2)
    for rank_result in results:
        assert rank_result["rank0-regression"] == _scalars("regression", _build("regression"))
        assert rank_result["rank0-clip"] == _scalars("clip", _build("clip"))
        assert rank_result["meta-init"] == _ScaledLinear.INIT
        assert "never initialised them" in rank_result["meta-clip"], rank_result["meta-clip"]
        assert "['logit_scale']" in rank_result["meta-clip"], rank_result["meta-clip"]


def _unused_and_penalty_only() -> dict:
    """Rank 1's forward leaves ``scale`` out (DDP's unused parameter); then a backward of a penalty on ``scale`` alone,
    rank-dependent, with no forward: the gradients each backward leaves, and the all-reduces counted."""
    import hf_zeropp
    from hf_zeropp.comm.replicated import KIND

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = hf_zeropp.shard_model(_ScaledLinear(), "zero3")
    model(torch.ones(2, 4), scaled=rank == 0).sum().backward()
    unused = float(model.scale.grad)
    model.zero_grad()
    ((rank + 1) * model.scale ** 2).backward()
    penalty = float(model.scale.grad)
    model.zero_grad()
    with torch.no_grad():
        full = float(model(torch.ones(2, 4), scaled=False).sum())  # d(sum(linear(x) * scale)) / d(scale), rank 0
    record = {"unused": unused, "penalty": penalty, "rank0_gradient": full,
              "calls": hf_zeropp.comm_stats(model)[KIND]["calls"]}
    torch.manual_seed(0)
    layer = torch.nn.Linear(6, 4)
    layer.weight = torch.nn.Parameter(torch.randn(6, 4).t())  # a transposed view: fully_shard refuses it
    hf_zeropp.shard_model(layer, "zero3")
    layer(torch.full((1, 6), float(rank + 1))).sum().backward()  # d/dW: every row is the input
    record["non_contiguous"] = (layer.weight.grad.tolist(), type(layer.bias).__name__,
                                hf_zeropp.comm_stats(layer)["implementations"]["replicated_parameters"][0])
    return record


def test_a_parameter_one_rank_leaves_unused_and_a_penalty_alone_are_averaged():
    """DDP's find_unused_parameters: an unused parameter contributes zero on that rank; a backward that reaches the
    parameter without any forward output is averaged too. Both ranks get the same values. A non-contiguous weight
    (the other kind fully_shard refuses) is replicated and averaged the same way, its bias sharded."""
    results = run_distributed(_unused_and_penalty_only, 2)
    for rank_result in results:
        assert rank_result["unused"] == pytest.approx(results[0]["rank0_gradient"] / 2, rel=EXACT)
        assert rank_result["penalty"] == pytest.approx(2 * _ScaledLinear.INIT * (1 + 2) / 2, rel=EXACT)
        assert rank_result["calls"] == 2
        gradient, bias, record = rank_result["non_contiguous"]
        assert gradient == [[1.5] * 6] * 4  # the mean of the ranks' inputs, 1 and 2
        assert bias == "DTensor", bias
        assert record.startswith("1 parameter FSDP2 cannot shard is replicated") and record.endswith(
            "weight (non-contiguous, stride (1, 4))"), record


def test_a_unit_that_gathers_no_weights_leaves_its_inputs_in_their_dtype():
    """bf16: FSDP2 casts a unit's inputs to bf16 to meet the weights it gathers in bf16. The RegressionModel gathers
    none (both parameters replicated), so its fp32 inputs stay fp32, as under stock DDP's autocast, whose elementwise
    ops stay in fp32 (Accelerate's test_script.py checks bf16 training of it against fp32 to 1e-6). A GPT-2 gathers
    weights in its root (the embeddings) and in every block: each casts."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_zeropp import ZeroPPConfig
    from hf_zeropp.engine.sharding import _mixed_precision_policies, _units

    config = ZeroPPConfig.preset("zero3", mixed_precision="bf16")
    regression = _build("regression")
    policies = _mixed_precision_policies(regression, [], config, set(regression.parameters()))
    assert not policies[regression].cast_forward_inputs and policies[regression].param_dtype == torch.bfloat16
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32))
    units = _units(gpt2, None)
    policies = _mixed_precision_policies(gpt2, units, config, set())
    assert len(units) == 2 and all(policy.cast_forward_inputs for policy in policies.values())
