"""Bad input: every invalid configuration, environment variable, file or call fails with a message naming the value
and the fix, before any collective.

Most of the README's table is tested in ``tests/config/test_config.py``,
``tests/integrations/test_integrations.py::test_bad_inputs_of_the_integrations`` and
``tests/kernels/test_kernels.py::test_bad_inputs_name_the_value_and_the_fix``; the cases they miss are here
(``MORE_BAD_CONFIGS``, ``test_bad_inputs_outside_the_config``). Several tests pin fixes (their docstrings say what
used to go wrong): the DeepSpeed bf16+fp16 clash and the wrap_modules and ZEROPP_NODE_SIZE messages.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import hf_zeropp
from hf_zeropp import ZeroPPConfig
from hf_zeropp.comm.topology import Topology

MORE_BAD_CONFIGS = [
    # stage
    (dict(stage=-1), ValueError, "stage=-1 is invalid; use 0 (data parallel), 1, 2 or 3"),
    (dict(stage=True), TypeError, "stage=True has type bool; expected int"),
    (dict(stage=3.0), TypeError, "stage=3.0 has type float; expected int"),
    # bits
    (dict(weight_bits=16), ValueError, "weight_bits=16 is not supported; use 8 or 4"),
    (dict(weight_bits="8"), TypeError, "weight_bits='8' has type str; expected int"),
    (dict(gradient_intra_bits=0), ValueError, "gradient_intra_bits=0 is not supported; use 8, 4 or None"),
    # block sizes
    (dict(block_size=-16), ValueError, "block_size=-16 must be a positive multiple of 8"),
    (dict(block_size=64.0), TypeError, "block_size=64.0 has type float; expected int"),
    (dict(gradient_block_size=4), ValueError, "gradient_block_size=4 must be a positive multiple of 8"),
    # hpZ / node sizes
    (dict(node_size=-2), ValueError, "node_size=-2 must be >= 1 (or None to detect it from the launch)"),
    (dict(node_size=2.0), TypeError, "node_size=2.0 has type float; expected int or None"),
    (dict(hpz_partition_size=2.5), TypeError, "hpz_partition_size=2.5 has type float; expected int or str"),
    (dict(qgz_pipeline_stages=-3), ValueError, "qgz_pipeline_stages=-3 must be >= 1"),
    # techniques on stages that cannot use them
    (dict(stage=1, hpz_partition_size=2), ValueError, "hpz_partition_size needs stage 3, but stage=1"),
    (dict(stage=0, hpz_partition_size="node"), ValueError, "hpz_partition_size needs stage 3, but stage=0"),
    (dict(stage=0, quantized_nontrainable_weights=True), ValueError,
     "quantized_nontrainable_weights needs stage 1 or 2 or 3, but stage=0"),
    # schedules
    (dict(quantized_weights_until=1.5), ValueError,
     "quantized_weights_until=1.5 must be a fraction of max_steps in (0, 1], e.g. 0.5"),
    (dict(hpz_until=0), ValueError, "hpz_until=0.0 must be a fraction of max_steps in (0, 1]"),
    (dict(quantized_gradients_until="half"), TypeError,
     "quantized_gradients_until='half' has type str; expected float or None"),
    # other wrong types and values
    (dict(stochastic_rounding=1), TypeError, "stochastic_rounding=1 has type int; expected bool"),
    (dict(seed=1.5), TypeError, "seed=1.5 has type float; expected int"),
    (dict(kernel_backend="CPP"), ValueError, "kernel_backend='CPP' is invalid; use one of ('reference', 'cpp'"),
    (dict(mixed_precision="bfloat16"), ValueError, "mixed_precision='bfloat16' is invalid; use one of"),
    # unknown keys and presets
    ({"preset": "zero4"}, ValueError, "unknown preset 'zero4'; choose one of"),
    ({"preset": "zeropp", "bogus": 1}, ValueError, "unknown hf_zeropp option(s) ['bogus']; valid options:"),
    # DeepSpeed configs
    ({"zero_optimization": [1]}, TypeError, "zero_optimization must be a mapping, got list"),
    ({"zero_optimization": {"stage": 4}}, ValueError, "stage=4 is invalid"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, ValueError,
     "zero_optimization.offload_param.device='nvme' (NVMe offload) is not supported by hf_zeropp; use device 'cpu'"),
    ({"zero_optimization": {"stage": 3, "zeropp_loco_param": {}}}, ValueError,
     "zero_optimization.zeropp_loco_param has no hf_zeropp equivalent; remove it"),
    ({"zero_optimization": {"stage": 0, "zero_quantized_gradients": True}}, ValueError,
     "quantized_gradients needs stage 1 or 2 or 3, but stage=0"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, ValueError,
     "hpz_partition_size=0 must be >= 1 (1 turns hpZ off)"),
    ({"zero_optimization": {"stage": 3}, "moe": {"enabled": True}}, ValueError,
     "DeepSpeed config key 'moe' cannot be mapped to hf_zeropp; remove it"),
    # not a mapping at all
    ([1, 2], TypeError, "a ZeroPPConfig needs a mapping, got list"),
]


@pytest.mark.parametrize("values,error,message", MORE_BAD_CONFIGS, ids=[str(c[0])[:60] for c in MORE_BAD_CONFIGS])
def test_more_bad_configs_name_the_value_and_the_fix(values, error, message):
    with pytest.raises(error) as raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ZeroPPConfig.from_dict(values)
    assert message in str(raised.value), str(raised.value)


@pytest.mark.parametrize(
    "config,world,local,message",
    [
        (dict(hpz_partition_size=3), 4, 4, "hpz_partition_size=3 must divide the world size 4"),
        (dict(node_size=4), 2, 2, "node_size=4 does not divide the world size 2"),
        (dict(hpz_partition_size=2, node_size=1), 4, 4,
         "hpz_partition_size=2 does not fit in a node of 1 ranks: its backward all-gather would cross nodes"),
    ],
)
def test_more_bad_launch_combinations(config, world, local, message):
    with pytest.raises(ValueError) as raised:
        Topology.from_config(ZeroPPConfig(**config), world, local_world_size=local)
    assert message in str(raised.value)


def test_bad_inputs_outside_the_config(tmp_path, monkeypatch):
    """Entry points other than ZeroPPConfig: shard_model, the environment, ZeroPPConfig.coerce (what every entry
    point does with its config argument), checkpoints. All of these fail before any process group exists."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="config must be a ZeroPPConfig, preset name, path, dict or None; got int"):
        hf_zeropp.shard_model(model, 42)
    with pytest.raises(FileNotFoundError, match="'/nonexistent/z.yaml' does not exist; check the path"):
        hf_zeropp.shard_model(model, "/nonexistent/z.yaml")
    with pytest.raises(RuntimeError, match="shard_model needs torch.distributed initialised: launch with torchrun"):
        hf_zeropp.shard_model(model, "zero3")
    with pytest.raises(FileNotFoundError, match="'/nonexistent/z.yaml' does not exist"):
        ZeroPPConfig.from_env({"ZEROPP_CONFIG": "/nonexistent/z.yaml"})
    with pytest.raises(ValueError, match="block_size=100 must be a positive multiple of 8"):
        ZeroPPConfig.from_env({"ZEROPP_BLOCK_SIZE": "100"})
    with pytest.raises(ValueError, match="ZEROPP_QUANTIZED_WEIGHTS_UNTIL='half' is not a number"):
        ZeroPPConfig.from_env({"ZEROPP_QUANTIZED_WEIGHTS_UNTIL": "half"})
    with pytest.raises(TypeError, match="zeropp must be a ZeroPPConfig, preset name, path, dict or None; got int"):
        ZeroPPConfig.coerce(42, argument="zeropp")
    monkeypatch.setenv("ZEROPP_NODE_SIZE", "0")
    with pytest.raises(ValueError, match="node_size=0 must be >= 1"):
        ZeroPPConfig.coerce("zero3")
    (tmp_path / "stage.yaml").write_text("stage: '3'\n")  # a quoted YAML number is a string
    with pytest.raises(TypeError, match="stage='3' has type str; expected int"):
        ZeroPPConfig.from_file(tmp_path / "stage.yaml")
    # a folder that is not a complete checkpoint (here: a crashed save's partial folder)
    partial = tmp_path / ".checkpoint-5.partial"
    partial.mkdir()
    with pytest.raises(FileNotFoundError, match="is not a complete hf_zeropp checkpoint \\(no zeropp_meta.json\\); "
                                                "pick one returned by latest_checkpoint"):
        hf_zeropp.load_checkpoint(partial, model)
    assert hf_zeropp.latest_checkpoint(tmp_path) is None
    assert hf_zeropp.latest_checkpoint(tmp_path / "missing") is None


def test_deepspeed_config_with_both_bf16_and_fp16_enabled_is_rejected():
    """from_deepspeed used to map bf16, then fp16, so such a config silently became fp16 (DeepSpeed rejects it)."""
    with pytest.raises(ValueError, match="bf16.*fp16"):
        ZeroPPConfig.from_dict({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                                "fp16": {"enabled": True}})


def test_wrap_modules_as_a_string_says_a_list_is_expected():
    """The type message used to describe list[str] | None as 'str or None': "has type str; expected str"."""
    with pytest.raises(TypeError) as raised:
        ZeroPPConfig(wrap_modules="GPT2Block")
    assert "list" in str(raised.value), str(raised.value)


def test_bad_zeropp_node_size_variable_is_named(monkeypatch):
    """ZeroPPConfig.coerce (formerly as_zeropp_config) used to call int() on it unchecked: "invalid literal for
    int() with base 10: 'two'"."""
    monkeypatch.setenv("ZEROPP_NODE_SIZE", "two")
    with pytest.raises(ValueError, match="ZEROPP_NODE_SIZE"):
        ZeroPPConfig.coerce("zero3")
