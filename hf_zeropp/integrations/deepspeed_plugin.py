"""``accelerator.state.deepspeed_plugin`` for scripts written for Accelerate's DeepSpeed path, with hf_zeropp in
place of DeepSpeed's engine.

Such scripts (Accelerate's ``examples/by_feature/deepspeed_with_config_support.py`` is the model) read the DeepSpeed
config through the plugin: ``"optimizer" in accelerator.state.deepspeed_plugin.deepspeed_config`` picks
``DummyOptim`` over ``torch.optim.AdamW`` (and ``"scheduler"`` a ``DummyScheduler``), and
``deepspeed_config["gradient_accumulation_steps"]`` sets the script's own accumulation. Stock Accelerate answers None
unless ``distributed_type`` is DEEPSPEED, so under hf_zeropp such a script would build a torch optimizer beside the
config's and Accelerate's rule refuses the pair. What hf_zeropp reports instead, and why:

- ``accelerator.state.deepspeed_plugin`` (and ``accelerator.deepspeed_plugin``) is Accelerate's own
  ``DeepSpeedPlugin`` for the DeepSpeed config hf_zeropp trains with: the launch's Accelerate DeepSpeed settings
  (``hf-zeropp launch`` hands them to the workers in :data:`PLUGIN_VARIABLE`) or the script's own
  ``Accelerator(deepspeed_plugin=...)``. "auto" is filled where Accelerate fills it: the precision when the
  Accelerator is made, the training loop's values (batch sizes, clipping, the optimizer's and scheduler's "auto")
  when ``prepare`` has seen the model, optimizer, scheduler and dataloaders. The ``zero_optimization`` tuning keys
  Accelerate fills from the model's hidden size stay "auto": hf_zeropp ignores them. The plugin is never selected:
  selecting it would make transformers build models under ``deepspeed.zero.Init``, and its ``zero3_init_flag`` is
  False (hf_zeropp's counterpart is ``hf-zeropp launch --load_in_slices``).
- ``accelerator.distributed_type`` stays MULTI_CPU / MULTI_GPU, what Accelerate runs (hf_zeropp's sharding in place
  of DDP). Reporting DEEPSPEED would send Accelerate's own ``prepare``, ``backward``, ``clip_grad_norm_``,
  ``save_state`` / ``load_state``, ``get_state_dict``, ``unwrap_model`` and its state's ``mixed_precision`` into
  DeepSpeed's engine, and scripts that branch on it do so to call the engine (``model.save_checkpoint``,
  ``model.module``), which a sharded model is not.
- Only the accelerator's own ``state`` answers (the same shared state, as another view of it): an
  ``AcceleratorState()`` made elsewhere still says None, and so does the Trainer's accelerator (the Trainer's
  ``is_deepspeed_enabled`` would take DeepSpeed's paths; its config reaches hf_zeropp through ``--deepspeed``).
  Accelerate's internals read the plugin only after checking for DEEPSPEED. A script that, seeing the plugin, calls
  DeepSpeed's own API (``deepspeed.zero.GatheredParameters``, ``deepspeed.initialize``) needs DeepSpeed's engine.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from accelerate.state import AcceleratorState

# the launch's DeepSpeed config as Accelerate's DeepSpeedPlugin made it (JSON), set by hf-zeropp launch
PLUGIN_VARIABLE = "HF_ZEROPP_DEEPSPEED_PLUGIN"


def launched_plugin() -> Any:
    """The plugin of the launch's Accelerate DeepSpeed settings, or None where the launch has none."""
    text = os.environ.get(PLUGIN_VARIABLE)
    if not text:
        return None
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=json.loads(text), zero3_init_flag=False)


class StateWithDeepSpeedPlugin(AcceleratorState):
    """The Accelerator's state (AcceleratorState is one state shared by all its instances) whose
    ``deepspeed_plugin`` is ``plugin``; every other attribute is the shared state's."""

    __slots__ = ("_zeropp_plugin",)  # beside the shared __dict__, so that no other view of the state sees it

    def __init__(self, plugin: Any) -> None:
        super().__init__()  # the state exists already: this only attaches to it
        self._zeropp_plugin = plugin

    @property
    def deepspeed_plugin(self) -> Any:
        return self._zeropp_plugin


def show_plugin(accelerator: Any, plugin: Any) -> None:
    """Make ``plugin`` the accelerator's ``state.deepspeed_plugin``, its precision "auto" filled from the accelerator
    as Accelerate's state fills it."""
    plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state = StateWithDeepSpeedPlugin(plugin)


def fill_plugin(plugin: Any, sections: dict[str, Any]) -> None:
    """Write the training loop's sections, "auto" filled when ``prepare`` built the loop, into the plugin's config,
    as Accelerate's ``prepare`` fills its plugin's."""
    plugin.deepspeed_config.update(copy.deepcopy(sections))
