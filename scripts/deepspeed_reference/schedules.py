"""DeepSpeed's own optimizers and LR schedulers, trained through its engine, recorded so that the main CI (which has
no DeepSpeed) can hold hf_zeropp/interop/deepspeed/optim.py to DeepSpeed's numbers.

Regenerate tests/fixtures/deepspeed/optim_schedules.json with

    DS_ACCELERATOR=cpu .venv-deepspeed/bin/python -m scripts.deepspeed_reference.schedules

Every case is one ``deepspeed.initialize`` on a 4->3 Linear in a single process (fp32, no ZeRO: the scheduler
wraps the same param groups under every stage), with the case's ``optimizer`` and ``scheduler`` sections in the
config and gradient clipping off (DeepSpeed 0.19.8 clips to norm 1.0 unless told otherwise, and that is the
config's ``gradient_clipping``, not the optimizer's), trained by ``engine(x)``, ``engine.backward(loss)`` and
``engine.step()`` on the same seeded batches. Per optimizer step it records what the optimizer applied (each
group's lr, betas or momentum, read just before the step), ``get_last_lr()`` after it, and the parameters after
PARAM_STEPS steps. Floats are stored as Python writes them, which round-trips them exactly. ``record`` is the loop
itself, shared with the tests that drive hf_zeropp's objects the same way."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "deepspeed" / "optim_schedules.json"
STEPS = 20
PARAM_STEPS = 5
STATE_STEP = 10
BATCH = 2

ADAM = {"type": "Adam", "params": {"lr": 1e-2}}


def _case(name, optimizer, scheduler=None, param_groups=1):
    return {"name": name, "optimizer": optimizer, "scheduler": scheduler, "param_groups": param_groups}


CASES = [
    _case("adam_w_mode_by_default", {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.8, 0.99], "eps": 1e-6,
                                                                  "weight_decay": 0.1}}),
    _case("adam_l2", {"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False, "weight_decay": 0.1}}),
    _case("adamw_ignores_adam_w_mode_false", {"type": "AdamW", "params": {"lr": 1e-2, "adam_w_mode": False,
                                                                          "weight_decay": 0.05}}),
    _case("adam_defaults", {"type": "Adam"}),
    _case("adamw_lowercase_fused_switches", {"type": "adamw", "params": {
        "lr": 3e-3, "bias_correction": True, "set_grad_none": True, "fp32_optimizer_states": True, "amsgrad": False}}),
    _case("torch_adamw_default_decay", {"type": "AdamW", "params": {"torch_adam": True, "lr": 1e-2}}),
    _case("torch_adam_l2_amsgrad", {"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": False, "lr": 1e-2,
                                                               "weight_decay": 0.1, "amsgrad": True}}),
    _case("adagrad", {"type": "Adagrad", "params": {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01,
                                                    "initial_accumulator_value": 0.1, "eps": 1e-10}}),
    _case("sgd_nesterov", {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01,
                                                     "nesterov": True}}),
    _case("sgd_dampening", {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.8, "dampening": 0.3}}),
    _case("rmsprop_centered", {"type": "RMSprop", "params": {"lr": 0.01, "momentum": 0.5, "centered": True}}),
    _case("warmup_log", ADAM, {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                                                              "warmup_num_steps": 8}}),
    _case("warmup_linear", ADAM, {"type": "WarmupLR", "params": {
        "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 8, "warmup_type": "linear"}}),
    _case("warmup_defaults_take_optimizer_lr", ADAM, {"type": "WarmupLR", "params": {}}),
    _case("warmup_one_step_counts_as_two", ADAM, {"type": "WarmupLR", "params": {
        "warmup_max_lr": 5e-3, "warmup_num_steps": 1, "warmup_type": "linear"}}),
    _case("warmup_unknown_type_is_log", ADAM, {"type": "WarmupLR", "params": {
        "warmup_max_lr": 5e-3, "warmup_num_steps": 6, "warmup_type": "cosine"}}),
    _case("warmup_per_group", ADAM, {"type": "WarmupLR", "params": {
        "warmup_min_lr": [1e-4, 0.0], "warmup_max_lr": [1e-2, 2e-2], "warmup_num_steps": 5,
        "warmup_type": "linear"}}, param_groups=2),
    _case("warmup_resumed_by_last_batch_iteration", ADAM, {"type": "WarmupLR", "params": {
        "warmup_max_lr": 5e-3, "warmup_num_steps": 10, "last_batch_iteration": 3}}),
    _case("warmup_decay_log", ADAM, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 15, "warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 5}}),
    _case("warmup_decay_linear", ADAM, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 15, "warmup_max_lr": 1e-2, "warmup_num_steps": 5, "warmup_type": "linear"}}),
    _case("warmup_decay_total_below_warmup", ADAM, {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 4, "warmup_num_steps": 6, "warmup_type": "linear"}}),
    _case("warmup_cosine_log", ADAM, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 15, "warmup_min_ratio": 0.1, "warmup_num_steps": 5, "cos_min_ratio": 0.05}}),
    _case("warmup_cosine_linear", ADAM, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 16, "warmup_min_ratio": 0.2, "warmup_num_steps": 4, "warmup_type": "linear"}}),
    _case("warmup_cosine_defaults", {"type": "SGD", "params": {"lr": 0.1}}, {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 12}}),
    _case("range_test_continuous", ADAM, {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0}}),
    _case("range_test_staircase", ADAM, {"type": "LRRangeTest", "params": {
        "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 3, "lr_range_test_step_rate": 2.0,
        "lr_range_test_staircase": True}}),
    _case("range_test_defaults", ADAM, {"type": "LRRangeTest", "params": {}}),
    _case("one_cycle_adam_momentum_and_decay", ADAM, {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 5, "cycle_second_step_size": 4,
        "decay_step_size": 2, "decay_lr_rate": 0.5, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
        "decay_mom_rate": 0.01}}),
    _case("one_cycle_stairs", ADAM, {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 6, "cycle_second_step_size": 5,
        "cycle_first_stair_count": 3, "cycle_second_stair_count": 2, "decay_step_size": 3, "decay_lr_rate": 0.2}}),
    _case("one_cycle_defaults_symmetric", ADAM, {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 4, "cycle_first_stair_count": 2}}),
    _case("one_cycle_without_momentum", ADAM, {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 3, "cycle_momentum": False,
        "decay_step_size": 1, "decay_lr_rate": 0.1}}),
    _case("one_cycle_sgd_keeps_momentum", {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, {
        "type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4,
                                       "cycle_second_step_size": 0}}),
    _case("one_cycle_per_group", ADAM, {"type": "OneCycle", "params": {
        "cycle_min_lr": [1e-3, 2e-3], "cycle_max_lr": [1e-2, 3e-2], "cycle_first_step_size": 3,
        "cycle_min_mom": [0.8, 0.7], "cycle_max_mom": [0.9, 0.95], "decay_step_size": 2,
        "decay_mom_rate": 0.02}}, param_groups=2),
    _case("torch_step_lr", ADAM, {"type": "StepLR", "params": {"step_size": 3, "gamma": 0.5}}),
]


def training_data(seed: int = 0) -> dict:
    """The model's starting weights and one (input, target) batch per step, as plain floats."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    generator = torch.Generator().manual_seed(seed + 1)
    return {"initial": {name: value.tolist() for name, value in model.state_dict().items()},
            "inputs": torch.randn(STEPS, BATCH, 4, generator=generator).tolist(),
            "targets": torch.randn(STEPS, BATCH, 3, generator=generator).tolist()}


def tiny_model(data: dict) -> torch.nn.Linear:
    model = torch.nn.Linear(4, 3)
    model.load_state_dict({name: torch.tensor(value) for name, value in data["initial"].items()})
    return model


def param_groups(model: torch.nn.Linear, count: int):
    return [{"params": [model.weight]}, {"params": [model.bias]}] if count == 2 else list(model.parameters())


def hyperparameters(optimizer) -> dict:
    """What the next optimizer step applies, per param group."""
    groups = optimizer.param_groups
    return {"lr": [group["lr"] for group in groups],
            "betas": [list(group["betas"]) for group in groups] if "betas" in groups[0] else None,
            "momentum": [group["momentum"] for group in groups] if "momentum" in groups[0] else None}


def record(optimizer, scheduler, model, data: dict, train_step) -> dict:
    """Train STEPS steps with ``train_step(x, y)`` (one forward, backward and optimizer step, then the scheduler's
    step) and note what each optimizer step applied and what the scheduler reports after it."""
    steps, params, state = [], None, None
    for index in range(STEPS):
        applied = hyperparameters(optimizer)
        train_step(torch.tensor(data["inputs"][index]), torch.tensor(data["targets"][index]))
        applied["last_lr"] = list(scheduler.get_last_lr()) if scheduler is not None else None
        steps.append(applied)
        if index + 1 == PARAM_STEPS:
            params = {name: value.tolist() for name, value in model.state_dict().items()}
        if index + 1 == STATE_STEP and scheduler is not None:
            state = scheduler.state_dict()
    return {"steps": steps, "params_after": params, "state_after": state}


def run_deepspeed(case: dict, data: dict) -> dict:
    """One case through DeepSpeed's engine, which builds the optimizer and scheduler from the config itself."""
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():  # one process, its store in memory: no port to collide with a parallel run
        for key in ("RANK", "LOCAL_RANK"):
            os.environ.setdefault(key, "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = tiny_model(data)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
              "gradient_clipping": 0.0, "optimizer": copy.deepcopy(case["optimizer"])}
    if case["scheduler"] is not None:
        config["scheduler"] = copy.deepcopy(case["scheduler"])
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, case["param_groups"]), config=config)

    def train_step(x, y):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()

    return record(optimizer, scheduler, model, data, train_step)


def main() -> None:
    data = training_data()
    cases = [{**case, **run_deepspeed(case, data)} for case in CASES]
    import deepspeed

    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps({"deepspeed": deepspeed.__version__, "torch": torch.__version__.split("+")[0],
                                   "steps": STEPS, "param_steps": PARAM_STEPS, "state_step": STATE_STEP,
                                   **data, "cases": cases}) + "\n")
    print(f"wrote {len(cases)} cases to {FIXTURE}")


if __name__ == "__main__":
    main()
