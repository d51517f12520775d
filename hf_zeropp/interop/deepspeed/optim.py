"""DeepSpeed's JSON ``optimizer`` and ``scheduler`` sections as plain torch objects, so that a DeepSpeed config
trains under hf_zeropp with DeepSpeed 0.19.8's numbers: the same update per step, the same learning rate (and
OneCycle momentum) at every optimizer step, and a scheduler that a DeepSpeed checkpoint's
``{"last_batch_iteration": k}`` resumes where DeepSpeed's would be.

The checks read the raw JSON before any process group exists, so a bad config fails before the launch spends
anything; values may still be "auto" there, which the caller fills from TrainingArguments before it builds.
docs/design.md ("DeepSpeed optimizers and schedulers") lists every type and what it becomes; the fixtures in
tests/fixtures/deepspeed/optim_schedules.json, written by DeepSpeed itself, hold the numbers these must give."""

from __future__ import annotations

import inspect
import math
import warnings

import torch
from torch.optim.lr_scheduler import LRScheduler

AUTO = "auto"
_ALTERNATIVE = ("use type 'AdamW' (or 'Adam', 'Adagrad', or a torch.optim class name such as 'SGD'), "
                "or give the Trainer a torch optimizer of your own")
_NO_TORCH_EQUIVALENT = {  # keyed by the lowercased type, since DeepSpeed matches its own names case-insensitively
    "lamb": "DeepSpeed's FusedLamb, a fused kernel that torch.optim has no counterpart for",
    "lion": "DeepSpeed's FusedLion / CPU Lion, which torch.optim does not have",
    "muadam": "the mup package's MuAdam (muP learning-rate scaling, not a torch optimizer)",
    "muadamw": "the mup package's MuAdamW (muP learning-rate scaling, not a torch optimizer)",
    "musgd": "the mup package's MuSGD (muP learning-rate scaling, not a torch optimizer)",
    "muon": "DeepSpeed's MuonWithAuxAdam, which splits parameters by a use_muon tag DeepSpeed puts on the model",
    "onebitadam": "1-bit Adam, which DeepSpeed 0.19.8 itself no longer has",
    "zerooneadam": "0/1 Adam, which DeepSpeed 0.19.8 itself no longer has",
    "onebitlamb": "1-bit LAMB, which DeepSpeed 0.19.8 itself no longer has",
}
# What DeepSpeed takes out of an Adam section before the optimizer class sees it; fp32_optimizer_states only
# matters to DeepSpeed's CPU-offload Adam.
_ADAM_SWITCHES = ("adam_w_mode", "torch_adam", "fp32_optimizer_states")
_FUSED_ADAM_KEYS = {"lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "set_grad_none"}
_FUSED_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def _optimizer_kind(type_name) -> str | type:
    """DeepSpeed's own names ("adam", "adamw", "adagrad") in any case; any other name is looked up as the exact
    torch.optim attribute, as DeepSpeed's engine does."""
    if not isinstance(type_name, str):
        raise ValueError(f"optimizer.type must be a string, got {type_name!r}: {_ALTERNATIVE}")
    lowered = type_name.lower()
    if lowered in _NO_TORCH_EQUIVALENT:
        raise ValueError(f"optimizer.type {type_name!r} is {_NO_TORCH_EQUIVALENT[lowered]}; hf_zeropp trains with "
                         f"torch optimizers only: {_ALTERNATIVE}")
    if lowered in ("adam", "adamw", "adagrad"):
        return lowered
    found = getattr(torch.optim, type_name, None)
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)) or found is torch.optim.Optimizer:
        raise ValueError(f"optimizer.type {type_name!r} is neither a DeepSpeed optimizer nor a torch.optim class "
                         f"(DeepSpeed matches torch names case-sensitively): {_ALTERNATIVE}")
    if found is torch.optim.LBFGS:
        raise ValueError("optimizer.type 'LBFGS' needs a closure at every step, which DeepSpeed's engine and the "
                         f"Trainer never pass: {_ALTERNATIVE}")
    return found


def _check_keywords(target, params: dict, where: str) -> None:
    """Unknown keys and missing required ones, judged by the signature of the class DeepSpeed would call."""
    signature = inspect.signature(target).parameters
    skipped = {"self", "params", "optimizer"}
    takes = {name for name, p in signature.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - skipped
    required = {name for name in takes if signature[name].default is inspect.Parameter.empty}
    if unknown := sorted(set(params) - takes):
        raise ValueError(f"{where}: unknown param(s) {unknown}, which DeepSpeed's {target.__name__} rejects; "
                         f"it takes {sorted(takes)}")
    if missing := sorted(required - set(params)):
        raise ValueError(f"{where}: missing required param(s) {missing} of DeepSpeed's {target.__name__}")


def _check_adam(params: dict, type_name: str) -> None:
    where = f"optimizer {type_name!r} params"
    given = {key: value for key, value in params.items() if key not in _ADAM_SWITCHES}
    if params.get("torch_adam", False):
        given.pop("foreach", None)
        _check_keywords(torch.optim.AdamW, given, where)  # Adam takes the same keywords as AdamW
        return
    if unknown := sorted(set(given) - _FUSED_ADAM_KEYS):
        raise ValueError(f"{where}: unknown param(s) {unknown}, which DeepSpeed's FusedAdam rejects; it takes "
                         f"{sorted(_FUSED_ADAM_KEYS | set(_ADAM_SWITCHES))}")
    if given.get("amsgrad", False) not in (False, AUTO):
        raise ValueError(f"{where}: amsgrad true is refused by DeepSpeed's FusedAdam; set torch_adam true to get "
                         "torch's AMSGrad, as DeepSpeed would")
    if given.get("bias_correction", True) not in (True, AUTO):
        raise ValueError(f"{where}: bias_correction false has no torch equivalent (torch.optim.Adam and AdamW "
                         "always correct the moments' bias); remove it to train with bias correction")


def check_optimizer(section: dict) -> None:
    """Refuse what DeepSpeed would refuse, and what has no torch equivalent, naming the key and what to use."""
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError(f"the optimizer section needs a 'type', got {section!r}: {_ALTERNATIVE}")
    kind = _optimizer_kind(section["type"])
    params = section.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"optimizer.params must be a mapping of keyword arguments, got {params!r}")
    if "max_grad_norm" in params:
        raise ValueError("'max_grad_norm' is not supported as an optimizer parameter (DeepSpeed refuses it too): "
                         "use the top-level DeepSpeed key 'gradient_clipping' (the Trainer's max_grad_norm)")
    if kind in ("adam", "adamw"):
        _check_adam(params, section["type"])
    else:
        _check_keywords(torch.optim.Adagrad if kind == "adagrad" else kind, params,
                        f"optimizer {section['type']!r} params")


def _refuse_auto(section: dict, name: str) -> None:
    if left := sorted(key for key, value in (section.get("params") or {}).items() if value == AUTO):
        raise ValueError(f"{name}.params {left} are still 'auto': fill them from TrainingArguments before building")


def build_optimizer(params, section: dict) -> torch.optim.Optimizer:
    """The torch optimizer whose update equals DeepSpeed's for this section.

    DeepSpeed's FusedAdam (and its CPU Adam) compute exactly torch's Adam step: bias-corrected moments, eps added
    to sqrt(v_hat), and with adam_w_mode weight decay applied as p -= lr * wd * p; without it, wd * p is added to the
    gradient (L2). So Adam maps to torch.optim.AdamW, or to torch.optim.Adam when adam_w_mode is false and the type
    is not AdamW. FusedAdam's default weight decay is 0, torch AdamW's 0.01, so FusedAdam's defaults go in
    explicitly; with torch_adam, DeepSpeed itself calls torch, torch's defaults included."""
    check_optimizer(section)
    _refuse_auto(section, "optimizer")
    kind = _optimizer_kind(section["type"])
    kwargs = dict(section.get("params") or {})
    if kind in ("adam", "adamw"):
        decoupled = kwargs.pop("adam_w_mode", True) or kind == "adamw"
        torch_adam = kwargs.pop("torch_adam", False)
        kwargs.pop("fp32_optimizer_states", None)
        if not torch_adam:
            for settled in ("bias_correction", "amsgrad", "set_grad_none"):  # checked to be torch's behaviour
                kwargs.pop(settled, None)
            kwargs = {**_FUSED_ADAM_DEFAULTS, **kwargs}
        kind = torch.optim.AdamW if decoupled else torch.optim.Adam
    elif kind == "adagrad":
        kind = torch.optim.Adagrad
    return kind(params, **kwargs)


def _per_group(optimizer, value, name: str) -> list:
    """A scalar for every param group, or DeepSpeed's per-group list, which must match the groups one to one."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(optimizer.param_groups):
            raise ValueError(f"expected {len(optimizer.param_groups)} values for {name}, got {len(value)}")
        return list(value)
    return [value] * len(optimizer.param_groups)


def _check_schedule_values(params: dict) -> None:
    """DeepSpeed's constructor errors, also raised from check_scheduler before any optimizer exists."""
    for key in ("warmup_num_steps", "lr_range_test_step_size"):
        value = params.get(key, AUTO)
        if value != AUTO and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"scheduler.params.{key} must be a positive integer, got {value!r}")
    first, second = params.get("cycle_first_step_size", AUTO), params.get("cycle_second_step_size", AUTO)
    if first != AUTO and float(first) <= 0:
        raise ValueError(f"scheduler.params.cycle_first_step_size must be positive, got {first!r}")
    if second not in (AUTO, None) and float(second) < 0:
        raise ValueError(f"scheduler.params.cycle_second_step_size must be non-negative, got {second!r}")


def _warmup_type(name: str) -> str:
    if name not in ("log", "linear"):
        warnings.warn(f"unknown warmup_type {name!r}: warming up with 'log', as DeepSpeed does", stacklevel=3)
        return "log"
    return name


def _warmup_fraction(warmup_type: str, iteration: int, warmup_num_steps: int) -> float:
    if warmup_type == "log":
        return (1.0 / math.log(warmup_num_steps)) * math.log(iteration + 1)
    return iteration / warmup_num_steps


class _DeepSpeedSchedule(LRScheduler):
    """A torch LRScheduler that counts like DeepSpeed's: torch's ``last_epoch`` is the number of ``step()`` calls,
    DeepSpeed's ``last_batch_iteration`` one less (-1 at construction, k - 1 after optimizer step k). Construction
    writes the schedule's value at -1 into the optimizer, as DeepSpeed's does, so optimizer step 1 applies it;
    ``step()`` after step k writes the value at k - 1, which step k + 1 applies. The state is DeepSpeed's own
    ``{"last_batch_iteration": k}``, so checkpoints pass between the two in both directions."""

    def __init__(self, optimizer, last_batch_iteration: int = -1):
        untouched = [(group["lr"], group.get("betas")) for group in optimizer.param_groups]
        super().__init__(optimizer)
        if last_batch_iteration != -1:  # DeepSpeed then leaves the optimizer's lr and betas as they were
            for group, (lr, betas) in zip(optimizer.param_groups, untouched):
                group["lr"] = lr
                if betas is not None:
                    group["betas"] = betas
            self.last_epoch = last_batch_iteration + 1
            self._last_lr = [group["lr"] for group in optimizer.param_groups]

    @property
    def last_batch_iteration(self) -> int:
        return self.last_epoch - 1

    def get_lr(self) -> list[float]:
        return self._lrs(self.last_epoch - 1)

    def _lrs(self, iteration: int) -> list[float]:
        raise NotImplementedError

    def _betas(self, iteration: int) -> list[tuple[float, float]] | None:
        return None

    def _write_betas(self) -> None:
        if (betas := self._betas(self.last_epoch - 1)) is not None:
            for group, pair in zip(self.optimizer.param_groups, betas):
                group["betas"] = pair

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        self._write_betas()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_epoch - 1}

    def load_state_dict(self, state_dict: dict) -> None:
        """Also writes the lr (and betas) DeepSpeed's optimizer held when that state was saved, since a DeepSpeed
        checkpoint's optimizer state may reach this optimizer without its param groups."""
        self.last_epoch = state_dict["last_batch_iteration"] + 1
        for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
            group["lr"] = lr
        self._write_betas()
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class WarmupLR(_DeepSpeedSchedule):
    """warmup_min_lr to warmup_max_lr (default: the optimizer's lr) over max(2, warmup_num_steps) iterations, log
    or linear, then flat. Iterations -1 and 0 both give warmup_min_lr, so optimizer steps 1 and 2 train at it."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1):
        _check_schedule_values({"warmup_num_steps": warmup_num_steps})
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = None if warmup_max_lr is None else _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
        return 1.0

    def _lrs(self, iteration: int) -> list[float]:
        if iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(iteration)
        return [low + (high - low) * gamma for low, high in zip(self.min_lrs, self.max_lrs or self.base_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR (its warmup_max_lr defaulting to 0.001 here), then linear decay reaching 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}",
                          stacklevel=2)

    def _gamma(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            return _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
        return max(0.0, float(self.total_num_steps - iteration)
                   / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_DeepSpeedSchedule):
    """The optimizer's lr scaled by a ratio: 0 at iteration -1 (optimizer step 1 trains at lr 0), warmup_min_ratio
    to 1 over the warmup, then a cosine down to cos_min_ratio at total_num_steps. The lr it scales is the one the
    optimizer had when the scheduler was built (torch's initial_lr)."""

    def __init__(self, optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log", last_batch_iteration: int = -1):
        _check_schedule_values({"warmup_num_steps": warmup_num_steps})
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        if total_num_steps < self.warmup_num_steps:
            warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}",
                          stacklevel=2)
        super().__init__(optimizer, last_batch_iteration)

    def _ratio(self, iteration: int) -> float:
        if iteration < self.warmup_num_steps:
            warm = _warmup_fraction(self.warmup_type, iteration, self.warmup_num_steps)
            return self.warmup_min_ratio + warm * (1. - self.warmup_min_ratio)
        cosine_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (iteration - self.warmup_num_steps + 1) / cosine_steps)
        return max(0.0, self.cos_min_ratio + (1. - self.cos_min_ratio) * ((1 + math.cos(math.pi * progress)) / 2))

    def _lrs(self, iteration: int) -> list[float]:
        if iteration < 0:
            return [0.0 for _ in self.base_lrs]
        ratio = self._ratio(iteration)
        return [base * ratio for base in self.base_lrs]


class LRRangeTest(_DeepSpeedSchedule):
    """lr_range_test_min_lr * (1 + step_rate * (iteration + 1) / step_size), the quotient floored when staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size: int = 2000,
                 lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False,
                 last_batch_iteration: int = -1):
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        _check_schedule_values({"lr_range_test_step_size": lr_range_test_step_size})
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def _lrs(self, iteration: int) -> list[float]:
        interval = (math.floor(float(iteration + 1) / self.step_size) if self.staircase
                    else float(iteration + 1) / self.step_size)
        return [low * (1 + self.step_rate * interval) for low in self.min_lrs]


class OneCycle(_DeepSpeedSchedule):
    """One triangle from cycle_min_lr up to cycle_max_lr (first step size) and back (second step size), optionally
    in stairs, then cycle_min_lr / (1 + decay_lr_rate * decay_steps / decay_step_size). With cycle_momentum and an
    optimizer that has betas, betas become (momentum, 0.99) -- DeepSpeed replaces beta2 by 0.99 -- with momentum
    moving inversely to the lr, except at construction, which writes cycle_min_mom. An optimizer without betas
    (SGD's momentum, say) keeps its momentum untouched, with a warning, as in DeepSpeed."""

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0., cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.,
                 last_batch_iteration: int = -1):
        _check_schedule_values({"cycle_first_step_size": cycle_first_step_size,
                                "cycle_second_step_size": cycle_second_step_size})
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (self.first_step_size if cycle_second_step_size is None
                                 else float(cycle_second_step_size))
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.decays_lr = not (math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0))
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            warnings.warn(f"cycle_momentum is off: {type(optimizer).__name__} has no betas, the only momentum "
                          "DeepSpeed's OneCycle cycles", stacklevel=2)
        if self.cycle_momentum:
            self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
            self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
            self.decay_mom_rate = decay_mom_rate
            self.decays_mom = not (math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0))
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, iteration: int) -> float:
        """0 at the cycle's start and end, 1 at its peak."""
        batch = iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1. + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            in_cycle = batch % self.total_size
            position = (in_cycle * stairs / self.first_step_size if in_cycle <= self.first_step_size
                        else (self.total_size - in_cycle) * stairs / self.second_step_size)
            scale = math.floor(position) / stairs
        return scale

    def _lrs(self, iteration: int) -> list[float]:
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [low + (high - low) * scale for low, high in zip(self.min_lrs, self.max_lrs)]
        if not self.decays_lr:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [low / factor for low in self.min_lrs]

    def _betas(self, iteration: int) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if iteration == -1:
            return [(low, 0.99) for low in self.min_moms]
        if iteration < self.total_size:
            scale = self._scale(iteration)
            return [(high - (high - low) * scale, 0.99) for low, high in zip(self.min_moms, self.max_moms)]
        if not self.decays_mom:
            return [(high, 0.99) for high in self.max_moms]
        factor = 1 + self.decay_mom_rate * ((iteration - self.total_size + 1) / self.decay_step_size)
        return [(high * factor, 0.99) for high in self.max_moms]


SCHEDULERS = {schedule.__name__: schedule for schedule in (WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest,
                                                            OneCycle)}
_TORCH_SCHEDULERS_JSON_CANNOT_DRIVE = {"LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler",
                                       "ReduceLROnPlateau"}


def _scheduler_class(type_name) -> type:
    """DeepSpeed's five by exact name, then any torch.optim.lr_scheduler class, as DeepSpeed's engine resolves."""
    if type_name in SCHEDULERS:
        return SCHEDULERS[type_name]
    found = getattr(torch.optim.lr_scheduler, type_name, None) if isinstance(type_name, str) else None
    if type_name in _TORCH_SCHEDULERS_JSON_CANNOT_DRIVE:
        raise ValueError(f"scheduler.type {type_name!r} needs Python callables, scheduler objects or a metric at "
                         f"every step, which DeepSpeed's engine cannot give from JSON: use one of {sorted(SCHEDULERS)}")
    if not (isinstance(found, type) and issubclass(found, LRScheduler)) or found.get_lr is LRScheduler.get_lr:
        raise ValueError(f"scheduler.type {type_name!r} is not a DeepSpeed scheduler nor a torch.optim.lr_scheduler "
                         f"class (names are case-sensitive): use one of {sorted(SCHEDULERS)}")
    return found


def check_scheduler(section: dict) -> None:
    """Refuse the types, params and values DeepSpeed's scheduler constructors would refuse."""
    if not isinstance(section, dict) or "type" not in section:
        raise ValueError(f"the scheduler section needs a 'type', got {section!r}: use one of {sorted(SCHEDULERS)}")
    schedule = _scheduler_class(section["type"])
    params = section.get("params")
    if not isinstance(params, dict):
        raise ValueError(f"scheduler.params must be a mapping of keyword arguments (DeepSpeed fails without one), "
                         f"got {params!r}")
    _check_keywords(schedule, params, f"scheduler {section['type']!r} params")
    if schedule in SCHEDULERS.values():
        _check_schedule_values(params)


def build_scheduler(optimizer: torch.optim.Optimizer, section: dict) -> LRScheduler:
    """The scheduler to step once per applied optimizer step -- never after a step skipped for overflow, which
    DeepSpeed's engine does not count either."""
    check_scheduler(section)
    _refuse_auto(section, "scheduler")
    return _scheduler_class(section["type"])(optimizer, **section["params"])
