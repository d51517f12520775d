"""The training loop of a DeepSpeed config, without DeepSpeed: "auto" filled where Transformers and Accelerate fill
it, the optimizer and scheduler built as DeepSpeed's engine builds them, gradients clipped and the loss scaled as it
does.

Under DeepSpeed the engine owns the optimizer step: it clips every step by the config's ``gradient_clipping``
(whatever the script asks ``clip_grad_norm_`` for), builds the config's ``optimizer`` on all trainable parameters in
one group, steps the config's ``scheduler`` once per optimizer step (not once per process, as Accelerate steps its
own schedulers) and skips it with a skipped fp16 step, and scales fp16 losses with its dynamic scaler (hysteresis,
a floor). :class:`hf_zeropp.Accelerator` and the Trainer mixin reproduce each of those from the resolved
:class:`DeepSpeedLoop`. The "auto" rules are Transformers' (``HfTrainerDeepSpeedConfig``: filled from
TrainingArguments, an explicit value that disagrees is refused with Transformers' own message) and Accelerate's
(``Accelerator._prepare_deepspeed``: filled from the Accelerator, ``DummyOptim`` and ``DummyScheduler``).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from ..._compat import fresh_grad_scaler_state
from .optim import build_optimizer, build_scheduler

AUTO = "auto"
DEEPSPEED_GRADIENT_CLIPPING = 1.0  # DeepSpeed's GRADIENT_CLIPPING_DEFAULT: what its engine clips to when unset


@dataclass
class DeepSpeedLoop:
    """A DeepSpeed config's training loop with every "auto" filled."""

    sections: dict[str, Any]

    @property
    def optimizer(self) -> dict[str, Any] | None:
        return self.sections.get("optimizer")

    @property
    def scheduler(self) -> dict[str, Any] | None:
        return self.sections.get("scheduler")

    @property
    def gradient_clipping(self) -> float:
        """The norm DeepSpeed's engine clips to every step: the config's, and where it has none DeepSpeed's default
        1.0 (not the Trainer's max_grad_norm); 0 never clips."""
        value = self.sections.get("gradient_clipping", DEEPSPEED_GRADIENT_CLIPPING)
        return float(value) if isinstance(value, (int, float)) and value > 0 else 0.0

    @property
    def gradient_accumulation_steps(self) -> int | None:
        value = self.sections.get("gradient_accumulation_steps")
        return int(value) if isinstance(value, (int, float)) else None

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        """The config's optimizer on the trainable ``params`` (or parameter groups), as DeepSpeed's engine builds it
        from the model parameters it is given: one group with the config's weight decay on every parameter, where the
        Trainer's own optimizer exempts biases and norms."""
        params = list(params)
        if params and isinstance(params[0], dict):
            params = [{**group, "params": [p for p in group["params"] if p.requires_grad]} for group in params]
        else:
            params = [p for p in params if p.requires_grad]
        return build_optimizer(params, self.optimizer)

    def build_scheduler(self, optimizer: torch.optim.Optimizer):
        return build_scheduler(optimizer, self.scheduler)

    def loss_scaler(self, device_type: str) -> DeepSpeedLossScaler:
        return DeepSpeedLossScaler(self.sections.get("fp16") or {}, device=device_type)


def refuse_training_loop(sections: dict[str, Any] | None, entry_point: str) -> None:
    """Raise where a DeepSpeed config asks for a training loop that ``entry_point`` (``shard_model``: the script
    builds its own optimizer and steps it) would silently not apply."""
    asked = [key for key in ("optimizer", "scheduler", "gradient_clipping") if (sections or {}).get(key)]
    if asked:
        raise ValueError(f"the DeepSpeed config's {', '.join(asked)} belong to the training loop, which {entry_point} "
                         f"does not run: train with the Trainer integration or hf_zeropp.Accelerator (which apply them "
                         f"as DeepSpeed does), or remove them from the config and build them in the script "
                         f"(hf_zeropp.interop.deepspeed.optim.build_optimizer / build_scheduler give DeepSpeed's)")


# ---------------------------------------------------------------- "auto" as Transformers fills it


def fill_from_training_arguments(sections: dict[str, Any], args: Any, num_training_steps: int) -> DeepSpeedLoop:
    """Fill "auto" from TrainingArguments as Transformers' ``HfTrainerDeepSpeedConfig`` does
    (``trainer_config_process`` then ``trainer_config_finalize``), and refuse explicit values that disagree with
    them with Transformers' own message, listing every mismatch."""
    config = copy.deepcopy(sections)
    mismatches: list[str] = []

    def fill(key: str, value: Any, name: str, must_match: bool = True) -> None:
        node, leaf = _node(config, key)
        if node is None:
            return
        if node.get(leaf) == AUTO:
            node[leaf] = value
        elif must_match and node.get(leaf) is not None and node.get(leaf) != value:
            mismatches.append(f"- ds {key}={node.get(leaf)} vs hf {name}={value}")

    exact_batch = not args.auto_find_batch_size
    fill("train_micro_batch_size_per_gpu", args.per_device_train_batch_size, "per_device_train_batch_size",
         exact_batch)
    fill("gradient_accumulation_steps", args.gradient_accumulation_steps, "gradient_accumulation_steps")
    fill("train_batch_size", args.world_size * args.per_device_train_batch_size * args.gradient_accumulation_steps,
         "train_batch_size (calculated)", exact_batch)
    fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    fill("scheduler.params.warmup_min_lr", 0, "", must_match=False)
    fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    fill("fp16.enabled", args.fp16 or args.fp16_full_eval, "fp16|fp16_full_eval")
    fill("bf16.enabled", args.bf16 or args.bf16_full_eval, "bf16|bf16_full_eval")
    fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
    fill("scheduler.params.warmup_num_steps", max(1, args.get_warmup_steps(num_training_steps)), "warmup_steps")
    if mismatches:
        raise ValueError("Please correct the following DeepSpeed config values that mismatch TrainingArguments"
                         " values:\n" + "\n".join(mismatches) +
                         "\nThe easiest method is to set these DeepSpeed config values to 'auto'.")
    return DeepSpeedLoop(config)


# ---------------------------------------------------------------- "auto" as Accelerate fills it


def fill_from_accelerator(sections: dict[str, Any], *, gradient_accumulation_steps: int, mixed_precision: str,
                          num_processes: int, split_batches: bool, micro_batch_size: int | None,
                          optimizer: Any = None, scheduler: Any = None) -> DeepSpeedLoop:
    """Fill "auto" as Accelerate's DeepSpeed path does when a model is prepared: the accumulation steps from the
    Accelerator, clipping 1.0, the batch sizes from the prepared dataloader, the precision from
    ``mixed_precision``, the optimizer's lr and weight decay from the script's ``DummyOptim``, and the scheduler's
    warmup and total steps from its ``DummyScheduler`` (total steps per process, since the engine steps it once per
    optimizer step). An "auto" left in the optimizer or scheduler is refused with Accelerate's message. Also checks
    the script's objects against the config as Accelerate does (an optimizer in both, a ``DummyOptim`` without
    one)."""
    from accelerate.utils.deepspeed import DummyOptim, DummyScheduler

    config = copy.deepcopy(sections)
    config.setdefault("gradient_accumulation_steps", 1)
    _check_placeholders(config, optimizer, scheduler, DummyOptim, DummyScheduler)
    values = {"gradient_accumulation_steps": gradient_accumulation_steps, "gradient_clipping": 1.0,
              "fp16.enabled": mixed_precision == "fp16", "bf16.enabled": mixed_precision in ("bf16", "fp8")}
    if micro_batch_size is not None:
        steps = config["gradient_accumulation_steps"]
        values["train_micro_batch_size_per_gpu"] = micro_batch_size
        if steps != AUTO:
            values["train_batch_size"] = micro_batch_size * steps * num_processes
    if isinstance(optimizer, DummyOptim):
        values.update({"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay})
    if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
        inner = scheduler.optimizer
        values.update({"scheduler.params.warmup_min_lr": 0,
                       "scheduler.params.warmup_max_lr": (getattr(inner, "lr", None)
                                                          if getattr(inner, "defaults", None) is None
                                                          else inner.defaults["lr"]),
                       "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps)})
        if scheduler.total_num_steps is not None:
            values["scheduler.params.total_num_steps"] = (scheduler.total_num_steps if split_batches else
                                                          math.ceil(scheduler.total_num_steps / num_processes))
    for key, value in values.items():
        node, leaf = _node(config, key)
        if node is not None and node.get(leaf) == AUTO:
            node[leaf] = value
    for key in ("optimizer", "scheduler"):
        for name, value in ((config.get(key) or {}).get("params") or {}).items():
            if value == AUTO:
                raise ValueError(f"`{key}.params.{name}` not found in kwargs. Please specify `{key}.params.{name}` "
                                 f"without `auto` (set to correct value) in the DeepSpeed config file or pass it in "
                                 f"kwargs.")
    check_batch_sizes(config, num_processes)
    return DeepSpeedLoop(config)


def _check_placeholders(config: dict[str, Any], optimizer: Any, scheduler: Any, dummy_optim: type,
                        dummy_scheduler: type) -> None:
    """Accelerate's rules for the script's optimizer and scheduler against the config's sections."""
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, dummy_optim):
            raise ValueError("You cannot specify an optimizer in the config file and in the code at the same time. "
                             "Please remove the optimizer from the config file or create "
                             "`accelerate.utils.DummyOptim` in the code.")
        if "optimizer" not in config and isinstance(optimizer, dummy_optim):
            raise ValueError("You cannot create a `DummyOptim` without specifying an optimizer in the config file.")
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, dummy_scheduler):
            raise ValueError("You cannot specify a scheduler in the config file and in the code at the same time. "
                             "Please remove the scheduler from the config file or create "
                             "`accelerate.utils.DummyScheduler` in the code.")
        if ("scheduler" not in config and isinstance(scheduler, dummy_scheduler)
                and scheduler.lr_scheduler_callable is None):
            raise ValueError("Either specify a scheduler in the config file or pass in the `lr_scheduler_callable` "
                             "parameter when using `accelerate.utils.DummyScheduler`.")
    if isinstance(optimizer, dummy_optim) and scheduler is not None and not isinstance(scheduler, dummy_scheduler):
        raise ValueError("You can only specify `accelerate.utils.DummyScheduler` in the code when using "
                         "`accelerate.utils.DummyOptim`.")


def check_batch_sizes(config: dict[str, Any], world_size: int) -> None:
    """DeepSpeed's rule, where all three are known: train_batch_size = micro batch x accumulation x world size."""
    train, micro, steps = (config.get(key) for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                         "gradient_accumulation_steps"))
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (train, micro, steps)) and \
            train != micro * steps * world_size:
        raise ValueError(f"Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
                         f"gradient_acc_step * world_size {train} != {micro} * {steps} * {world_size}: set "
                         f"train_batch_size and train_micro_batch_size_per_gpu to \"auto\", or make them agree")


def _node(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    """The dict holding ``dotted``'s last key, or None where a section on the way is missing (nothing to fill)."""
    *path, leaf = dotted.split(".")
    node: Any = config
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            return None, leaf
    return (node, leaf) if isinstance(node, dict) else (None, leaf)


# ---------------------------------------------------------------- fp16 loss scaling as DeepSpeed does it


class DeepSpeedLossScaler(ShardedGradScaler):
    """torch's sharded grad scaler with DeepSpeed's update rule (``DynamicLossScaler``): the scale starts at
    2**initial_scale_power, halves on an overflow only once ``hysteresis`` overflows have been seen (and never below
    ``min_loss_scale``), and doubles after ``loss_scale_window`` clean steps counted from the step after the last
    overflow; a ``loss_scale`` above 0 is static. An overflow with the scale at the floor stops the run, as in
    DeepSpeed. torch's rule differs in all of these (no hysteresis, no floor, growth one step earlier), which
    changes which fp16 steps are skipped."""

    def __init__(self, fp16: dict[str, Any], device: str) -> None:
        static = float(fp16.get("loss_scale", 0) or 0)
        self.static = static > 0
        init = static if self.static else 2.0 ** fp16.get("initial_scale_power", 16)
        super().__init__(device=device, init_scale=init, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=int(fp16.get("loss_scale_window", 1000)))
        self.min_scale = float(fp16.get("min_loss_scale", 1))
        self.delayed_shift = int(fp16.get("hysteresis", 2))
        self.consecutive_hysteresis = bool(fp16.get("consecutive_hysteresis", False))
        self.cur_hysteresis, self.cur_iter, self.last_overflow_iter = self.delayed_shift, 0, -1

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        if new_scale is not None or not self._enabled:
            return super().update(new_scale)
        found = [inf for state in self._per_optimizer_states.values()
                 for inf in state["found_inf_per_device"].values()]
        if not found:
            raise AssertionError("No inf checks were recorded prior to update.")
        overflow = bool(sum(inf.item() for inf in found))
        scale = self._scale.item()
        if not self.static:
            scale = self._next_scale(scale, overflow)
        self.cur_iter += 1
        self._scale.fill_(scale)
        self._per_optimizer_states = defaultdict(fresh_grad_scaler_state)

    def _next_scale(self, scale: float, overflow: bool) -> float:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if scale == self.min_scale:
                    raise FloatingPointError(
                        f"fp16 gradients overflowed with the loss scale already at min_loss_scale={self.min_scale:g}:"
                        f" DeepSpeed stops the run here, and so does hf_zeropp; lower fp16.min_loss_scale, or train "
                        f"in bf16")
                scale = max(scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
            return scale
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.delayed_shift
        stable = self.cur_iter - self.last_overflow_iter - 1
        if stable > 0 and stable % self._growth_interval == 0:
            if not self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            scale *= 2.0
        return scale

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "deepspeed": {"cur_hysteresis": self.cur_hysteresis,
                                                      "cur_iter": self.cur_iter,
                                                      "last_overflow_iter": self.last_overflow_iter}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        for name, value in state_dict.pop("deepspeed", {}).items():
            setattr(self, name, value)
        super().load_state_dict(state_dict)
