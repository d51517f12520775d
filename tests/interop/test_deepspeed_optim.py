"""hf_zeropp.interop.deepspeed.optim held to DeepSpeed 0.19.8 itself. The main CI compares with what DeepSpeed's engine
wrote into tests/fixtures/deepspeed/optim_schedules.json (python -m scripts.deepspeed_reference.schedules): the lr,
betas and momentum every optimizer step applies, get_last_lr() after it, the parameters after a few steps, and
DeepSpeed's checkpointed scheduler state. The tests marked ``deepspeed`` (scripts/test_deepspeed.sh) run DeepSpeed
live, on randomized sections and on the configs it must refuse, so an upgrade that changes a formula shows here.

Learning rates are Python floats computed by the same formulas, so they must agree to the last bit (rel 1e-12 only
leaves room for another platform's libm in log and cos). Parameters get a tolerance: DeepSpeed's Adam is its own
float32 C++ kernel (bias corrections and the step size rounded to float, its own operation order), so each step
differs from torch's Adam by rounding in the parameters' last bits; after five steps that stays below 1e-6 of the
tensor's largest magnitude, about eight float32 ulps, where a wrong rule (eps placement, bias correction, decay mode,
a wrong lr) moves parameters by 1e-3 or more."""

from __future__ import annotations

import json
import random
import warnings

import pytest
import torch
from paths import DEEPSPEED_FIXTURES

from hf_zeropp.interop.deepspeed.optim import (SCHEDULERS, LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR,
                                               WarmupLR, build_optimizer, build_scheduler, check_optimizer,
                                               check_scheduler)
from scripts.deepspeed_reference.schedules import PARAM_STEPS, STEPS, hyperparameters, param_groups, record, tiny_model

FIXTURE = json.loads((DEEPSPEED_FIXTURES / "optim_schedules.json").read_text())
CASES = {case["name"]: case for case in FIXTURE["cases"]}
SCHEDULED = [name for name, case in CASES.items() if case["scheduler"] and case["scheduler"]["type"] in SCHEDULERS]


def _build(case: dict, data: dict):
    model = tiny_model(data)
    with warnings.catch_warnings():  # DeepSpeed's own warnings (unknown warmup_type, ...) are asserted below
        warnings.simplefilter("ignore", UserWarning)
        optimizer = build_optimizer(param_groups(model, case["param_groups"]), case["optimizer"])
        scheduler = build_scheduler(optimizer, case["scheduler"]) if case["scheduler"] else None
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler):
    def train_step(x, y):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return train_step


def run_hf_zeropp(case: dict, data: dict) -> dict:
    model, optimizer, scheduler = _build(case, data)
    return record(optimizer, scheduler, model, data, _train_step(model, optimizer, scheduler))


def _flat(values) -> list[float]:
    return [x for value in values for x in (value if isinstance(value, list) else [value])]


def assert_same_hyperparameters(got: dict, expected: dict, where: str) -> None:
    for key in ("lr", "betas", "momentum", "last_lr"):
        if expected[key] is None:
            assert got[key] is None, f"{where}: {key}"
        else:
            assert _flat(got[key]) == pytest.approx(_flat(expected[key]), rel=1e-12, abs=0), f"{where}: {key}"


def assert_same_run(got: dict, expected: dict) -> None:
    for number, (ours, theirs) in enumerate(zip(got["steps"], expected["steps"], strict=True), 1):
        assert_same_hyperparameters(ours, theirs, f"optimizer step {number}")
    for name, value in expected["params_after"].items():
        theirs = torch.tensor(value)
        torch.testing.assert_close(torch.tensor(got["params_after"][name]), theirs, rtol=1e-6,
                                   atol=1e-6 * theirs.abs().max().item(), msg=f"{name} after {PARAM_STEPS} steps")


@pytest.mark.parametrize("name", CASES)
def test_every_step_trains_as_deepspeed_does(name):
    assert FIXTURE["steps"] == STEPS and FIXTURE["param_steps"] == PARAM_STEPS
    assert_same_run(run_hf_zeropp(CASES[name], FIXTURE), CASES[name])


@pytest.mark.parametrize("name", SCHEDULED)
def test_state_is_deepspeeds_and_resumes_where_deepspeed_would_be(name):
    """DeepSpeed's state after its 10th step, loaded into a fresh scheduler, puts lr (and betas) where DeepSpeed's
    optimizer was, and the remaining steps apply DeepSpeed's lrs."""
    case, resume_at = CASES[name], FIXTURE["state_step"]
    model, optimizer, scheduler = _build(case, FIXTURE)
    scheduler.load_state_dict(case["state_after"])
    assert list(case["state_after"]) == ["last_batch_iteration"] and scheduler.state_dict() == case["state_after"]
    assert list(scheduler.get_last_lr()) == pytest.approx(case["steps"][resume_at - 1]["last_lr"], rel=1e-12)
    train_step = _train_step(model, optimizer, scheduler)
    for index in range(resume_at, STEPS):
        expected = case["steps"][index]
        assert_same_hyperparameters({**hyperparameters(optimizer), "last_lr": expected["last_lr"]}, expected,
                                    f"resumed, optimizer step {index + 1}")
        train_step(torch.tensor(FIXTURE["inputs"][index]), torch.tensor(FIXTURE["targets"][index]))
        assert list(scheduler.get_last_lr()) == pytest.approx(expected["last_lr"], rel=1e-12)


@pytest.mark.parametrize("name", ["warmup_log", "warmup_cosine_linear", "one_cycle_adam_momentum_and_decay",
                                  "range_test_staircase"])
def test_state_dict_round_trips_with_the_optimizer_mid_schedule(name):
    """What the Trainer does on resume: a fresh optimizer and scheduler from the same sections, the optimizer's
    state loaded, then the scheduler's; the rest of the run equals the uninterrupted one."""
    case, stop = CASES[name], 7
    model, optimizer, scheduler = _build(case, FIXTURE)
    train_step = _train_step(model, optimizer, scheduler)
    for index in range(stop):
        train_step(torch.tensor(FIXTURE["inputs"][index]), torch.tensor(FIXTURE["targets"][index]))
    saved_optimizer, saved_scheduler = optimizer.state_dict(), json.loads(json.dumps(scheduler.state_dict()))
    resumed_model, resumed_optimizer, resumed_scheduler = _build(case, FIXTURE)
    resumed_model.load_state_dict(model.state_dict())
    resumed_optimizer.load_state_dict(saved_optimizer)
    resumed_scheduler.load_state_dict(saved_scheduler)
    train_step = _train_step(resumed_model, resumed_optimizer, resumed_scheduler)
    for index in range(stop, STEPS):
        assert_same_hyperparameters({**hyperparameters(resumed_optimizer), "last_lr": None},
                                    {**case["steps"][index], "last_lr": None}, f"optimizer step {index + 1}")
        train_step(torch.tensor(FIXTURE["inputs"][index]), torch.tensor(FIXTURE["targets"][index]))


def test_deepspeeds_surprises_are_in_its_own_numbers():
    """The behaviour docs/design.md describes, read off DeepSpeed's output: WarmupLR trains optimizer steps 1 and 2
    at warmup_min_lr; WarmupCosineLR trains step 1 at lr 0; OneCycle's construction writes (cycle_min_mom, 0.99)
    as betas, replacing beta2, and the first step moves beta1 next to cycle_max_mom; SGD's momentum never cycles."""
    warmup = CASES["warmup_log"]["steps"]
    assert warmup[0]["lr"] == warmup[1]["lr"] == [1e-4] and warmup[2]["lr"] > [1e-4]
    assert CASES["warmup_cosine_log"]["steps"][0]["lr"] == [0.0]
    cycle = CASES["one_cycle_adam_momentum_and_decay"]["steps"]
    assert cycle[0]["betas"] == [[0.85, 0.99]] and cycle[1]["betas"][0][0] == pytest.approx(0.93)
    assert {step["momentum"][0] for step in CASES["one_cycle_sgd_keeps_momentum"]["steps"]} == {0.9}
    assert CASES["warmup_resumed_by_last_batch_iteration"]["steps"][0]["lr"] == [1e-2]  # the optimizer's own lr


@pytest.mark.parametrize(("section", "torch_class", "expected"), [
    ({"type": "Adam"}, torch.optim.AdamW, {"weight_decay": 0.0, "lr": 1e-3, "eps": 1e-8}),
    ({"type": "Adam", "params": {"adam_w_mode": False}}, torch.optim.Adam, {"weight_decay": 0.0}),
    ({"type": "ADAMW", "params": {"adam_w_mode": False}}, torch.optim.AdamW, {"weight_decay": 0.0}),
    ({"type": "AdamW", "params": {"torch_adam": True}}, torch.optim.AdamW, {"weight_decay": 0.01}),
    ({"type": "adagrad", "params": {"lr": 0.5}}, torch.optim.Adagrad, {"lr": 0.5}),
    ({"type": "RMSprop"}, torch.optim.RMSprop, {"lr": 0.01}),
])
def test_each_type_becomes_the_documented_torch_class(section, torch_class, expected):
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], section)
    assert type(optimizer) is torch_class
    assert {key: optimizer.defaults[key] for key in expected} == expected


@pytest.mark.parametrize(("section", "match"), [
    ({"type": "Lamb", "params": {"lr": 1e-3}}, r"'Lamb' is DeepSpeed's FusedLamb.*use type 'AdamW'"),
    ({"type": "lion"}, r"'lion' is DeepSpeed's FusedLion.*use type 'AdamW'"),
    ({"type": "OneBitAdam", "params": {"freeze_step": 10}}, r"'OneBitAdam' is 1-bit Adam, which DeepSpeed 0\.19\.8"),
    ({"type": "ZeroOneAdam"}, r"'ZeroOneAdam' is 0/1 Adam"),
    ({"type": "OneBitLamb"}, r"'OneBitLamb' is 1-bit LAMB"),
    ({"type": "MuAdamW"}, r"'MuAdamW' is the mup package's MuAdamW.*use type 'AdamW'"),
    ({"type": "MuAdam"}, r"'MuAdam' is the mup package's MuAdam "),
    ({"type": "MuSGD"}, r"'MuSGD' is the mup package's MuSGD"),
    ({"type": "Muon"}, r"'Muon' is DeepSpeed's MuonWithAuxAdam.*use type 'AdamW'"),
    ({"type": "sgd"}, r"'sgd' is neither a DeepSpeed optimizer nor a torch.optim class.*case-sensitively"),
    ({"type": "LBFGS"}, r"'LBFGS' needs a closure"),
    ({"params": {"lr": 1e-3}}, r"needs a 'type'"),
    ({"type": "AdamW", "params": {"max_grad_norm": 1.0}}, r"'max_grad_norm' is not supported.*'gradient_clipping'"),
    ({"type": "Adam", "params": {"momentum": 0.9}},
     r"unknown param\(s\) \['momentum'\], which DeepSpeed's FusedAdam rejects; it takes \['adam_w_mode', 'amsgrad'"),
    ({"type": "Adam", "params": {"torch_adam": True, "bias_correction": True}},
     r"unknown param\(s\) \['bias_correction'\], which DeepSpeed's AdamW rejects"),
    ({"type": "AdamW", "params": {"amsgrad": True}}, r"amsgrad true is refused by DeepSpeed's FusedAdam; set torch"),
    ({"type": "Adam", "params": {"bias_correction": False}}, r"bias_correction false has no torch equivalent"),
    ({"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}},
     r"unknown param\(s\) \['betas'\], which DeepSpeed's SGD rejects"),
    ({"type": "Adagrad", "params": {"momentum": 0.9}}, r"unknown param\(s\) \['momentum'\].*Adagrad rejects"),
])
def test_refused_optimizer_sections_name_the_key_and_the_alternative(section, match):
    with pytest.raises(ValueError, match=match):
        check_optimizer(section)


SCHEDULER_REFUSALS = [
    ({"type": "WarmupLR", "params": {"total_num_steps": 10}},
     r"unknown param\(s\) \['total_num_steps'\], which DeepSpeed's WarmupLR rejects; it takes"),
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
     r"missing required param\(s\) \['total_num_steps'\] of DeepSpeed's WarmupDecayLR"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3}}, r"missing required param\(s\) \['cycle_max_lr'\]"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}}, r"warmup_num_steps must be a positive integer, got 0"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 10.0}},
     r"warmup_num_steps must be a positive integer, got 10\.0"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": -3}},
     r"warmup_num_steps must be a positive integer, got -3"),
    ({"type": "LRRangeTest", "params": {"lr_range_test_step_size": 0}},
     r"lr_range_test_step_size must be a positive integer, got 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_first_step_size": 0}},
     r"cycle_first_step_size must be positive, got 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-3, "cycle_max_lr": 1e-2, "cycle_second_step_size": -1}},
     r"cycle_second_step_size must be non-negative, got -1"),
    ({"type": "warmuplr", "params": {}}, r"'warmuplr' is not a DeepSpeed scheduler.*case-sensitive.*'WarmupLR'"),
    ({"type": "WarmupLR"}, r"scheduler.params must be a mapping"),
]


@pytest.mark.parametrize(("section", "match"), [*SCHEDULER_REFUSALS,
    ({"type": "ReduceLROnPlateau", "params": {}}, r"'ReduceLROnPlateau' needs .* a metric.*use one of \['LRRangeTest'"),
    ({"type": "LambdaLR", "params": {}}, r"'LambdaLR' needs Python callables"),
    ({"params": {}}, r"needs a 'type'")])
def test_refused_scheduler_sections_name_the_key_and_the_alternative(section, match):
    with pytest.raises(ValueError, match=match):
        check_scheduler(section)


def test_auto_passes_the_checks_and_stops_the_builders():
    optimizer_section = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}}
    scheduler_section = {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto", "warmup_min_lr": "auto",
                                                             "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
    check_optimizer(optimizer_section)
    check_scheduler(scheduler_section)
    with pytest.raises(ValueError, match=r"optimizer.params \['betas', 'eps', 'lr', 'weight_decay'\] are still"):
        build_optimizer([torch.nn.Parameter(torch.zeros(2))], optimizer_section)
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"type": "AdamW"})
    with pytest.raises(ValueError, match=r"scheduler.params \['total_num_steps', .*\] are still 'auto'"):
        build_scheduler(optimizer, scheduler_section)


def test_per_group_values_must_match_the_param_groups():
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"type": "AdamW"})
    with pytest.raises(ValueError, match=r"expected 1 values for warmup_min_lr, got 2"):
        build_scheduler(optimizer, {"type": "WarmupLR", "params": {"warmup_min_lr": [0.0, 0.1]}})


@pytest.mark.parametrize(("section", "match"), [
    ({"type": "WarmupLR", "params": {"warmup_type": "cosine"}}, r"unknown warmup_type 'cosine': warming up with 'log'"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 5}}, r"total_num_steps 5 is less than warmup_num_steps"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}}, r"cycle_momentum is off: SGD"),
])
def test_what_deepspeed_only_warns_about_is_a_warning(section, match):
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"type": "SGD", "params": {"lr": 0.1}})
    with pytest.warns(UserWarning, match=match):
        build_scheduler(optimizer, section)


def test_schedulers_are_torch_schedulers():
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], {"type": "AdamW"})
    for schedule in (WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest, OneCycle):
        assert issubclass(schedule, torch.optim.lr_scheduler.LRScheduler)
    scheduler = build_scheduler(optimizer, {"type": "WarmupDecayLR", "params": {"total_num_steps": 10,
                                                                                "warmup_num_steps": 5}})
    assert scheduler.get_last_lr() == [0.0] and scheduler.last_batch_iteration == -1


# ---- the DeepSpeed lane: DeepSpeed itself, live ----

def _random_cases(seed: int) -> list[dict]:
    rng = random.Random(seed)

    def lr():
        return 10 ** rng.uniform(-4, -1)

    def per_group(make, groups):
        return [make() for _ in range(groups)] if groups == 2 and rng.random() < 0.5 else make()

    def optimizer():
        return rng.choice([
            {"type": rng.choice(["Adam", "AdamW", "adamw"]), "params": {
                "lr": lr(), "betas": [rng.uniform(0.5, 0.95), rng.uniform(0.9, 0.9999)],
                "eps": 10 ** rng.uniform(-8, -3), "weight_decay": rng.uniform(0, 0.2),
                "adam_w_mode": rng.random() < 0.5, "torch_adam": rng.random() < 0.3}},
            {"type": "SGD", "params": {"lr": lr(), "momentum": rng.uniform(0, 0.95),
                                       "weight_decay": rng.uniform(0, 0.1)}},
            {"type": "Adagrad", "params": {"lr": lr(), "lr_decay": rng.uniform(0, 0.1)}}])

    def scheduler(groups, kind):
        warmup = {"warmup_num_steps": rng.randint(1, 12), "warmup_type": rng.choice(["log", "linear"])}
        total = {"total_num_steps": rng.randint(1, 25)}
        first = rng.randint(1, 8)
        return [
            {"type": "WarmupLR", "params": {**warmup, "warmup_min_lr": per_group(lr, groups) if rng.random() < 0.7
                                            else 0.0, **({"warmup_max_lr": lr()} if rng.random() < 0.5 else {})}},
            {"type": "WarmupDecayLR", "params": {**warmup, **total, "warmup_max_lr": per_group(lr, groups)}},
            {"type": "WarmupCosineLR", "params": {**warmup, **total, "warmup_min_ratio": rng.uniform(0, 0.5),
                                                  "cos_min_ratio": rng.uniform(0, 0.5)}},
            {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": per_group(lr, groups),
                                               "lr_range_test_step_size": rng.randint(1, 6),
                                               "lr_range_test_step_rate": rng.uniform(0, 5),
                                               "lr_range_test_staircase": rng.random() < 0.5}},
            {"type": "OneCycle", "params": {
                "cycle_min_lr": per_group(lambda: lr() / 10, groups), "cycle_max_lr": lr(),
                "cycle_first_step_size": first, "cycle_second_step_size": rng.choice([None, rng.randint(0, 8)]),
                "cycle_first_stair_count": rng.choice([0, 0, rng.randint(1, 4)]),
                "cycle_second_stair_count": rng.choice([None, rng.randint(0, 4)]),
                "decay_step_size": rng.randint(0, 4), "decay_lr_rate": rng.uniform(0, 1),
                "cycle_momentum": rng.random() < 0.8, "cycle_min_mom": rng.uniform(0.6, 0.85),
                "cycle_max_mom": per_group(lambda: rng.uniform(0.86, 0.95), groups),
                "decay_mom_rate": rng.uniform(0, 0.05)}}][kind]

    cases = []
    for number, kind in enumerate([None, *range(len(SCHEDULERS)), *rng.sample(range(len(SCHEDULERS)), 2)]):
        groups = rng.choice([1, 2])
        cases.append({"name": f"seed{seed}-{number}", "optimizer": optimizer(),
                      "scheduler": None if kind is None else scheduler(groups, kind), "param_groups": groups})
    return cases


@pytest.mark.deepspeed
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_sections_train_as_deepspeed_does_live(seed):
    pytest.importorskip("deepspeed")
    from scripts.deepspeed_reference.schedules import run_deepspeed, training_data

    data = training_data(seed)
    for case in _random_cases(seed):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            expected = run_deepspeed(case, data)
        try:
            assert_same_run(run_hf_zeropp(case, data), expected)
        except AssertionError as error:
            raise AssertionError(f"{case}: {error}") from error


@pytest.mark.deepspeed
def test_the_fixture_is_what_this_deepspeed_writes():
    pytest.importorskip("deepspeed")
    from scripts.deepspeed_reference.schedules import CASES as SCRIPT_CASES
    from scripts.deepspeed_reference.schedules import run_deepspeed

    assert [case["name"] for case in SCRIPT_CASES] == list(CASES)
    for case in SCRIPT_CASES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            written = run_deepspeed(case, FIXTURE)
        assert_same_run(written, CASES[case["name"]])
        assert written["state_after"] == CASES[case["name"]]["state_after"], case["name"]


@pytest.mark.deepspeed
@pytest.mark.parametrize("sections", [
    {"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
    {"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}},
    {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "bias_correction": True}}},
    {"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}},
    {"optimizer": {"type": "sgd"}},
    {"optimizer": {"type": "OneBitAdam"}},
    {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "betas": [0.9, 0.99]}}},
    *[{"optimizer": {"type": "AdamW"}, "scheduler": section} for section, _ in SCHEDULER_REFUSALS],
])
def test_what_is_refused_deepspeed_refuses_too_live(sections):
    """Every refusal that stands for DeepSpeed's own (not one for a type without a torch equivalent) is one
    DeepSpeed raises for at initialization."""
    pytest.importorskip("deepspeed")
    import deepspeed

    from scripts.deepspeed_reference.schedules import run_deepspeed

    case = {"optimizer": sections["optimizer"], "scheduler": sections.get("scheduler"), "param_groups": 1}
    with pytest.raises((ValueError, TypeError, AssertionError, RuntimeError, KeyError)):
        run_deepspeed(case, FIXTURE)
    assert deepspeed.__version__ == FIXTURE["deepspeed"]
