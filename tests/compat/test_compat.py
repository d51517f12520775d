"""hf_zeropp._compat against the installed torch / transformers / accelerate / TRL: the private APIs it relies on.

Every entry of ``_compat`` is exercised here, each inside ``entry(name)``: when an upstream rename or behaviour
change breaks one, the failure names the entry and the upstream symbol it reaches into (``_compat.UPSTREAM``).
Single process: a one-rank gloo group for the FSDP2 checks, a CPU Accelerator for the accelerate ones.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hf_zeropp import _compat


@contextlib.contextmanager
def entry(name: str):
    """Turn any error inside into a failure naming ``_compat.<name>`` and the upstream symbol behind it."""
    try:
        yield
    except Exception as error:  # assertion failures included: pytest.fail raises a BaseException
        pytest.fail(f"hf_zeropp._compat.{name} -> {_compat.UPSTREAM[name]} does not work with the installed "
                    f"versions ({_installed()}; hf_zeropp/_compat/ says which were checked): "
                    f"{type(error).__name__}: {error}", pytrace=True)


def _installed() -> str:
    found = []
    for package in ("torch", "transformers", "accelerate", "peft", "trl"):
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def test_every_entry_is_exercised_here():
    names = set(re.findall(r'entry\("(\w+)"\)', Path(__file__).read_text()))
    assert set(_compat.__all__) - {"UPSTREAM"} <= names, sorted(set(_compat.__all__) - names)
    assert set(_compat.UPSTREAM) == set(_compat.__all__)


# ---------------------------------------------------------------- torch / FSDP2


def test_fsdp_param_groups_reads_the_single_group_state_of_torch_2_11():
    """torch 2.11's FSDPState holds one optional ``_fsdp_param_group`` instead of the list ``_fsdp_param_groups``
    (seen on the GPU machine, which has torch 2.11: docs/results/2026-11-26-gpu-h200.md)."""

    class Unit(nn.Module):
        def __init__(self, group):
            super().__init__()
            self.state = type("FSDPState", (), {"_fsdp_param_group": group})()

        def _get_fsdp_state(self):
            return self.state

    group = object()
    assert _compat.fsdp_param_groups(Unit(group)) == [group]
    assert _compat.fsdp_param_groups(Unit(None)) == []  # a unit that manages no parameters


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    timeout = datetime.timedelta(seconds=77)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        yield timeout
    finally:
        dist.destroy_process_group()


class _Gather(_compat.AllGather):
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append(("all_gather", _compat.in_backward()))
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _Scatter(_compat.ReduceScatter):
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append(("reduce_scatter", _compat.in_backward()))
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _threaded_ranks_sum() -> list[list[float]]:
    """Three rank threads all-reduce their rank + 1 twice and return what they saw."""
    import threading

    seen: list = [None] * 3
    with _compat.threaded_process_groups() as (store, stop_all):
        def rank_main(rank):
            dist.init_process_group("threaded", rank=rank, world_size=3, store=store)
            totals = []
            for _ in range(2):
                value = torch.tensor([rank + 1.0])
                dist.all_reduce(value)
                totals.append(float(value))
            seen[rank] = totals
            dist.destroy_process_group()

        threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    return seen


def _parameters(function) -> list[str]:
    return list(inspect.signature(function).parameters)


def test_torch_fsdp2_internals(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    with entry("process_group_timeout"):
        assert _compat.process_group_timeout(dist.group.WORLD, "cpu") == one_rank_group
    with entry("default_store"):
        store = _compat.default_store()
        assert store.add("compat/counter", 1) == 1 and store.add("compat/counter", 1) == 2
    with entry("threaded_process_groups"):
        seen_by_rank = _threaded_ranks_sum()
        assert seen_by_rank == [[6.0, 6.0], [6.0, 6.0], [6.0, 6.0]], seen_by_rank
        assert dist.get_world_size() == 1  # this process's own group is back

    with entry("AllGather"):
        assert isinstance(_compat.AllGather, type), _compat.AllGather
        assert _parameters(_compat.AllGather.__call__) == ["self", "output_tensor", "input_tensor", "group",
                                                           "async_op"]
        assert _parameters(_compat.AllGather.allocate) == ["self", "size", "dtype", "device"]
        _Gather([])  # no abstract method hf_zeropp's collectives lack
    with entry("ReduceScatter"):
        assert isinstance(_compat.ReduceScatter, type), _compat.ReduceScatter
        assert _parameters(_compat.ReduceScatter.__call__) == ["self", "output_tensor", "input_tensor", "group", "op",
                                                               "async_op"]
        assert _parameters(_compat.ReduceScatter.allocate) == ["self", "size", "dtype", "device"]
        _Scatter([])
    with entry("in_backward"):
        assert _compat.in_backward() is False

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    block = model[0]
    world_mesh = init_device_mesh("cpu", (1,))
    with entry("hsdp_mesh_info"):
        secondary = _compat.hsdp_mesh_info(init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")),
                                           shard_mesh_dim=1, replicate_mesh_dim=0)
        assert secondary.shard_mesh_size == 1
    seen = []
    with entry("post_forward_mesh_info_override"):
        fsdp_internal = __import__("torch.distributed.fsdp._fully_shard._fully_shard", fromlist=["_"])
        original = fsdp_internal._get_post_forward_mesh_info

        def choose(reshard_after_forward, mesh_info):
            seen.append(reshard_after_forward)
            return secondary if reshard_after_forward is True else None  # None: FSDP's own

        with _compat.post_forward_mesh_info_override(choose):
            fully_shard(block, mesh=world_mesh, reshard_after_forward=True)
            fully_shard(model, mesh=world_mesh, reshard_after_forward=False)
        assert seen == [True, False], seen  # fully_shard asked the override for both units
        other = nn.Linear(2, 2)
        fully_shard(other, mesh=world_mesh, reshard_after_forward=True)
        assert seen == [True, False], seen  # outside the block FSDP's own is used
        if original.__name__ == "_get_post_forward_mesh_info":  # the first override in this process installs it
            assert fsdp_internal._get_post_forward_mesh_info is not original
    with entry("fsdp_param_groups"):
        block_groups, root_groups = _compat.fsdp_param_groups(block), _compat.fsdp_param_groups(model)
        assert len(block_groups) == 1 and len(root_groups) == 1, (block_groups, root_groups)
    with entry("fsdp_param_group"):
        assert _compat.fsdp_param_group(block) is block_groups[0]
        assert _compat.fsdp_param_group(model) is root_groups[0]
    block_group, root_group = block_groups[0], root_groups[0]
    with entry("group_parameters"):
        layout = _compat.group_parameters(block_group)
        assert [id(p) for p, _ in layout] == [id(block.weight), id(block.bias)]  # the registered shards, in order
        assert all(isinstance(p, DTensor) and n == p.numel() for p, n in layout), layout  # one rank: no padding
        assert {id(p) for p, _ in _compat.group_parameters(root_group)} == {id(p) for p in [*model[1].parameters(),
                                                                                            *model[2].parameters()]}
    with entry("group_shard_world_size"):
        assert _compat.group_shard_world_size(block_group) == 1
    with entry("group_reshards_after_forward"):
        assert _compat.group_reshards_after_forward(block_group)
        assert not _compat.group_reshards_after_forward(root_group)
    with entry("local_tensor"):
        local = _compat.local_tensor(block.weight)
        assert type(local) is torch.Tensor and torch.equal(local, block.weight.to_local())
        plain = torch.ones(2)
        assert _compat.local_tensor(plain) is plain

    calls: list = []  # FSDP2 skips the collectives on one rank: these only check that FSDP takes them
    for module in (block, model):
        module.set_force_sum_reduction_for_comms(True)
        module.set_custom_all_gather(_Gather(calls))
        module.set_custom_reduce_scatter(_Scatter(calls))
    in_backward: list = []
    x = torch.randn(3, 4, requires_grad=True)
    x.register_hook(lambda grad: in_backward.append(_compat.in_backward()))
    x.register_hook(lambda grad: _compat.queue_backward_callback(lambda: in_backward.append("after")))
    with entry("group_is_sharded"):
        assert _compat.group_is_sharded(block_group) and _compat.group_is_sharded(root_group)
    with entry("group_gathered_bytes"):
        assert _compat.group_gathered_bytes(block_group) == 0
        loss = model(x).square().sum()
        # the root keeps its weights gathered; the block keeps its post-forward shard on `secondary`
        assert _compat.group_gathered_bytes(root_group) >= 4 * (6 + 6 + 12 + 2)
        assert _compat.group_gathered_bytes(block_group) >= 4 * (24 + 6)
    with entry("group_is_sharded"):
        assert not _compat.group_is_sharded(block_group) and not _compat.group_is_sharded(root_group)
    observed: list = []
    with entry("observe_gradient_reduction"):
        for group in (block_group, root_group):
            _compat.observe_gradient_reduction(group, lambda presence, group=group: observed.append((group,
                                                                                                     presence)))
    with entry("in_backward"):
        loss.backward()
        assert in_backward[0] is True, in_backward
    with entry("observe_gradient_reduction"):  # each group once, before its reduction, every weight with a gradient
        assert [(group, presence) for group, presence in observed] == [(block_group, [True, True]),
                                                                       (root_group, [True] * 4)], observed
    with entry("queue_backward_callback"):
        assert in_backward == [True, "after"], in_backward  # run once the backward has finished
    with entry("set_post_forward_mesh_info"):
        for module in (block, model):
            module.reshard()
        _compat.set_post_forward_mesh_info(block_group, None)  # the group's own mesh: plain resharding
        with torch.no_grad():
            model(x)
        assert _compat.group_gathered_bytes(block_group) == 0  # resharded fully after forward
        model.reshard()
        _compat.set_post_forward_mesh_info(block_group, secondary)
        with torch.no_grad():
            model(x)
        assert _compat.group_gathered_bytes(block_group) > 0  # the post-forward shard is back
    with entry("unshard_all"):
        model.reshard()
        block.reshard()
        _compat.unshard_all(model)
        assert _compat.group_gathered_bytes(block_group) >= 4 * (24 + 6)  # gathered without a forward
        _compat.unshard_all(model)  # already gathered: nothing happens
    with entry("keep_all_gathered"):
        model.reshard()
        with torch.no_grad():
            model(x)  # the block keeps its hpZ secondary shard: entering gathers through that shard's mesh
        with _compat.keep_all_gathered(model):
            assert not _compat.group_reshards_after_forward(block_group)
            assert _compat.group_gathered_bytes(block_group) >= 4 * (24 + 6)  # gathered on entry
            with torch.no_grad():
                model(x)
            assert _compat.group_gathered_bytes(block_group) >= 4 * (24 + 6)  # kept gathered
        assert _compat.group_reshards_after_forward(block_group)  # each group's own setting is back
        assert not _compat.group_reshards_after_forward(root_group)
        model.reshard()
        block.reshard()

    with entry("apply_activation_checkpointing"):
        plain_model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        first = plain_model[0]
        _compat.apply_activation_checkpointing(plain_model, check_fn=lambda m: m is first)
        assert type(plain_model[0]).__name__ == "CheckpointWrapper" and isinstance(plain_model[1], nn.Linear)
        plain_model(torch.ones(1, 2)).sum().backward()


# ---------------------------------------------------------------- transformers (and TRL's trainers)

_HOOKS = ("_move_model_to_device", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")


def _trainer_classes() -> list[type]:
    from transformers import Trainer

    classes = [Trainer]
    try:
        import trl
    except ImportError:
        return classes
    for name in ("SFTTrainer", "DPOTrainer", "GRPOTrainer"):
        try:
            classes.append(getattr(trl, name))
        except (ImportError, AttributeError):  # a trainer this TRL does not have, or whose extras are missing
            pass
    return classes


def test_grad_scaler_per_optimizer_state():
    """A scaler with its own update rule (DeepSpeed's) resets the per-optimizer record as GradScaler.update does:
    the fresh record must be what a GradScaler starts each iteration with, so that the next step unscales again."""
    with entry("fresh_grad_scaler_state"):
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(model(torch.ones(1, 2)).sum()).backward()
        scaler.step(optimizer)
        assert scaler._per_optimizer_states[id(optimizer)]["stage"] != _compat.fresh_grad_scaler_state()["stage"]
        fresh = _compat.fresh_grad_scaler_state()
        assert fresh == scaler._per_optimizer_states[id(object())]  # a defaultdict's new entry: the same record


def test_dynamo_internals():
    """A ``torch.compile(module)`` wrapper is seen through, and the recompile limit is raised, never lowered."""
    from torch._dynamo import config

    with entry("uncompiled"):
        module = nn.Linear(2, 2)
        wrapper = torch.compile(module, backend="eager")
        assert _compat.uncompiled(wrapper) is module and _compat.uncompiled(module) is module
    with entry("raise_recompile_limit"):
        before = config.recompile_limit
        try:
            assert _compat.raise_recompile_limit(before + 5) == (before, before + 5) == (before, config.recompile_limit)
            assert _compat.raise_recompile_limit(1) == (before + 5, before + 5)
        finally:
            config.recompile_limit = before


def _tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=8, n_layer=1, n_head=2))


def test_transformers_internals(tmp_path):
    import transformers
    import transformers.trainer as trainer_module
    from transformers import Trainer, TrainingArguments

    with entry("no_split_modules"):
        assert _compat.no_split_modules(_tiny_gpt2()) == ["GPT2Block"]
        assert _compat.no_split_modules(nn.Linear(2, 2)) == []

    with entry("run_init_with_hooks"):
        model = _tiny_gpt2()
        before, after = [], []
        _compat.run_init_with_hooks(model, lambda m: before.append(id(m)), lambda m: after.append(id(m)))
        assert before == after, "before/after must bracket each module's init"
        assert {id(model.transformer.wte), id(model.transformer.h[0].mlp.c_fc), id(model)} <= set(before)
        assert not any("_initialize_weights" in vars(m) for m in model.modules())  # the wrappers are gone

    with entry("init_non_persistent_buffers"):
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1)
        LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
        with torch.device("meta"):
            on_meta = AutoModelForCausalLM.from_config(config)
        assert on_meta.model.rotary_emb.inv_freq.is_meta
        assert _compat.init_non_persistent_buffers(on_meta) == []
        expected = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").model.rotary_emb.inv_freq
        assert torch.equal(on_meta.model.rotary_emb.inv_freq, expected)

    with entry("trainer_accelerator_class"):
        method = Trainer.create_accelerator_and_postprocess
        assert "Accelerator" in method.__code__.co_names and method.__globals__ is vars(trainer_module), (
            "Trainer.create_accelerator_and_postprocess no longer builds transformers.trainer.Accelerator")
        original = trainer_module.Accelerator

        def factory(*args, **kwargs):
            raise AssertionError("not called here")

        with _compat.trainer_accelerator_class(factory):
            assert trainer_module.Accelerator is factory
        assert trainer_module.Accelerator is original
        for cls in _trainer_classes():  # TRL's trainers must build their Accelerator through Trainer's method
            own = cls.create_accelerator_and_postprocess
            assert own is method or "Accelerator" not in own.__code__.co_names, (
                f"{cls.__name__} builds its own Accelerator")

    with entry("TrainerHooks"):
        source = inspect.getsource(trainer_module)
        for name in _HOOKS:
            assert f"self.{name}(" in source, f"transformers.Trainer no longer calls {name}"
            ours = list(inspect.signature(getattr(_compat.TrainerHooks, name)).parameters)
            for cls in _trainer_classes():
                upstream = list(inspect.signature(getattr(cls, name)).parameters)
                assert upstream == ours, f"{cls.__name__}.{name}{upstream} vs TrainerHooks {ours}"
        upstream_calls = []

        class Upstream:
            def _move_model_to_device(self, model, device):
                upstream_calls.append(("move", model, device))

            def _save_optimizer_and_scheduler(self, output_dir):
                upstream_calls.append(("save", output_dir))

            def _load_optimizer_and_scheduler(self, checkpoint):
                upstream_calls.append(("load", checkpoint))

        class Probe(_compat.TrainerHooks, Upstream):
            def _zeropp_move_model_to_device(self, model, device, upstream):
                upstream(model, device)

            def _zeropp_save_optimizer_and_scheduler(self, output_dir, upstream):
                upstream(output_dir)

            def _zeropp_load_optimizer_and_scheduler(self, checkpoint, upstream):
                upstream(checkpoint)

        probe = Probe()
        probe._move_model_to_device("m", "cpu")
        probe._save_optimizer_and_scheduler("out")
        probe._load_optimizer_and_scheduler("ckpt")
        assert upstream_calls == [("move", "m", "cpu"), ("save", "out"), ("load", "ckpt")], upstream_calls

    with entry("trainer_save"):
        parameters = inspect.signature(Trainer._save).parameters
        assert {"output_dir", "state_dict"} <= set(parameters), list(parameters)
        saved = []

        class Saving:
            def _save(self, output_dir=None, state_dict=None):
                saved.append((output_dir, state_dict))

        _compat.trainer_save(Saving(), "out", {"w": 1})
        assert saved == [("out", {"w": 1})]

    with entry("extend_valid_dict_fields"):
        @dataclass
        class Args(TrainingArguments):
            zeropp: dict | str | None = None

        _compat.extend_valid_dict_fields(Args, TrainingArguments, "zeropp")
        assert Args._VALID_DICT_FIELDS[-1] == "zeropp"
        assert set(TrainingArguments._VALID_DICT_FIELDS) < set(Args._VALID_DICT_FIELDS)
        args = Args(output_dir=str(tmp_path), zeropp='{"stage": 3}', report_to="none", use_cpu=True)
        assert args.zeropp == {"stage": 3}, f"transformers {transformers.__version__} did not parse it: {args.zeropp}"

    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    stock = LlamaForCausalLM.from_pretrained(tmp_path / "bf16")
    with entry("default_load_dtype_is_auto"):
        assert stock.dtype == (torch.bfloat16 if _compat.default_load_dtype_is_auto() else torch.float32)

    with entry("hub_kernels_by_default"):
        assert getattr(stock, "use_kernels", False) == _compat.hub_kernels_by_default()

    with entry("build_from_config"):
        for model_class in (LlamaForCausalLM, AutoModelForCausalLM):
            with torch.device("meta"):
                empty = _compat.build_from_config(model_class, stock.config, dtype=torch.float16,
                                                  attn_implementation="eager", trust_remote_code=None)
            assert type(empty) is LlamaForCausalLM
            assert {n: (p.shape, p.is_meta, p.dtype) for n, p in empty.state_dict().items()} == {
                n: (p.shape, True, torch.float16) for n, p in stock.state_dict().items()}
            assert empty.config._attn_implementation == "eager"


# ---------------------------------------------------------------- accelerate


def test_accelerate_internals(tmp_path, monkeypatch):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    for variable in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(variable, raising=False)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = accelerate.Accelerator(cpu=True)
        model = nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with entry("is_accelerate_prepared"):
            assert not _compat.is_accelerate_prepared(model)
            model, optimizer = accelerator.prepare(model, optimizer)
            assert _compat.is_accelerate_prepared(model) and _compat.is_accelerate_prepared(optimizer)
        with entry("accelerator_models"):
            models = _compat.accelerator_models(accelerator)
            assert isinstance(models, list) and [id(m) for m in models] == [id(model)], models
        with entry("accelerator_optimizers"):
            optimizers = _compat.accelerator_optimizers(accelerator)
            assert isinstance(optimizers, list) and [id(o) for o in optimizers] == [id(optimizer)], optimizers
        with entry("accelerator_registry"):
            with _compat.accelerator_registry(accelerator, [], []):
                assert _compat.accelerator_models(accelerator) == [] == _compat.accelerator_optimizers(accelerator)
                accelerator.save_state(str(tmp_path / "hidden"))
            assert _compat.accelerator_models(accelerator) is models
            assert _compat.accelerator_optimizers(accelerator) is optimizers
            accelerator.save_state(str(tmp_path / "shown"))
            hidden = {p.name for p in (tmp_path / "hidden").iterdir()}
            shown = {p.name for p in (tmp_path / "shown").iterdir()}
            assert not any(n.startswith(("model", "optimizer")) for n in hidden), hidden  # save_state reads them
            assert any(n.startswith("model") for n in shown) and any(n.startswith("optimizer") for n in shown), shown
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
