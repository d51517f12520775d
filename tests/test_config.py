"""ZeroPPConfig: constructors and every bad input, each failing with a message that names the value and the fix."""

from __future__ import annotations

import json

import pytest

from hf_zeropp import PRESETS, ZeroPPConfig


def test_presets_and_dict_round_trip():
    config = ZeroPPConfig.preset("zeropp", node_size=2)
    assert (config.stage, config.quantized_weights, config.hpz_partition_size, config.quantized_gradients) == (
        3, True, "node", True)
    assert ZeroPPConfig.from_dict(config.to_dict()) == config
    assert ZeroPPConfig.from_dict({"preset": "zero2", "mixed_precision": "bf16"}).stage == 2
    assert set(PRESETS) >= {"ddp", "zero1", "zero2", "zero3", "zeropp", "zeropp-accurate"}


def test_every_preset_has_its_config_file_in_recipes():
    """recipes/zeropp/<preset>.yaml is the same configuration as the preset (the files are what the docs show)."""
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "recipes" / "zeropp"
    for path in sorted(folder.glob("*.yaml")):
        assert ZeroPPConfig.from_file(path) == ZeroPPConfig.preset(path.stem), path.name
    accurate = ZeroPPConfig.preset("zeropp-accurate")
    assert (accurate.gradient_hadamard, accurate.gradient_bits, accurate.quantized_gradients) == (64, 4, True)


def test_from_file_yaml_json_and_nested(tmp_path):
    (tmp_path / "a.yaml").write_text("stage: 3\nquantized_weights: true\nblock_size: 128\n")
    (tmp_path / "b.json").write_text(json.dumps({"stage": 2, "mixed_precision": "bf16"}))
    (tmp_path / "c.yaml").write_text("zeropp:\n  preset: zeropp\n  gradient_bits: 8\n")
    assert ZeroPPConfig.from_file(tmp_path / "a.yaml").block_size == 128
    assert ZeroPPConfig.from_file(tmp_path / "b.json").mixed_precision == "bf16"
    nested = ZeroPPConfig.from_file(tmp_path / "c.yaml")
    assert nested.quantized_gradients and nested.gradient_bits == 8


def test_deepspeed_config_is_mapped(tmp_path):
    ds = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "zero_quantized_weights": True,
            "zero_hpz_partition_size": 8,
            "zero_quantized_gradients": True,
            "overlap_comm": True,
            "reduce_bucket_size": 5e8,
        },
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    with pytest.warns(UserWarning, match="ignores DeepSpeed-only tuning keys"):
        config = ZeroPPConfig.from_file(path)
    assert (config.stage, config.quantized_weights, config.hpz_partition_size, config.quantized_gradients,
            config.mixed_precision) == (3, True, 8, True, "bf16")


def test_from_env_with_file_and_overrides(tmp_path):
    (tmp_path / "z.yaml").write_text("preset: zeropp\n")
    env = {"ZEROPP_CONFIG": str(tmp_path / "z.yaml"), "ZEROPP_NODE_SIZE": "2", "ZEROPP_QUANTIZED_GRADIENTS": "false",
           "PATH": "/bin"}
    config = ZeroPPConfig.from_env(env)
    assert config.node_size == 2 and not config.quantized_gradients and config.quantized_weights
    assert ZeroPPConfig.from_env({"ZEROPP_CONFIG": "zero2"}).stage == 2
    assert ZeroPPConfig.from_env({"ZEROPP_HPZ_PARTITION_SIZE": "node", "ZEROPP_STAGE": "3"}).hpz_partition_size == "node"


def test_resolve_fills_in_node_and_hpz_sizes():
    resolved = ZeroPPConfig.preset("zeropp").resolve(world_size=8, local_world_size=4)
    assert (resolved.node_size, resolved.hpz_size, resolved.nodes) == (4, 4, 2)
    resolved = ZeroPPConfig(stage=3, node_size=2).resolve(world_size=8, local_world_size=8)
    assert (resolved.node_size, resolved.hpz_size) == (2, 1)


BAD_CONFIGS = [
    (dict(stage=4), ValueError, "stage=4 is invalid; use 0 (data parallel), 1, 2 or 3"),
    (dict(stage="3"), TypeError, "stage='3' has type str; expected int"),
    (dict(weight_bits=3), ValueError, "weight_bits=3 is not supported; use 8 or 4"),
    (dict(gradient_bits=2), ValueError, "gradient_bits=2 is not supported"),
    (dict(gradient_intra_bits=16), ValueError, "gradient_intra_bits=16 is not supported"),
    (dict(block_size=100), ValueError, "block_size=100 must be a positive multiple of 8 (the kernels' alignment), e.g. 104"),
    (dict(block_size=0), ValueError, "block_size=0 must be a positive multiple of 8"),
    (dict(gradient_block_size=12), ValueError, "gradient_block_size=12 must be a positive multiple of 8"),
    (dict(mixed_precision="fp8"), ValueError, "mixed_precision='fp8' is invalid"),
    (dict(reduce_dtype="int8"), ValueError, "reduce_dtype='int8' is invalid"),
    (dict(kernel_backend="triton"), ValueError, "kernel_backend='triton' is invalid"),
    (dict(hpz_partition_size=0), ValueError, "hpz_partition_size=0 must be >= 1 (1 turns hpZ off)"),
    (dict(hpz_partition_size="rack"), ValueError, "hpz_partition_size='rack' must be an integer or 'node'"),
    (dict(stage=2, hpz_partition_size=2), ValueError, "hpz_partition_size needs stage 3, but stage=2"),
    (dict(stage=0, quantized_weights=True), ValueError, "quantized_weights needs stage 1 or 2 or 3, but stage=0"),
    (dict(stage=0, quantized_gradients=True), ValueError, "quantized_gradients needs stage 1 or 2 or 3"),
    (dict(qgz_pipeline_stages=0), ValueError, "qgz_pipeline_stages=0 must be >= 1"),
    (dict(node_size=0), ValueError, "node_size=0 must be >= 1"),
    (dict(quantized_weights="yes"), TypeError, "quantized_weights='yes' has type str; expected bool"),
    (dict(blocksize=64), ValueError, "unknown hf_zeropp option(s) ['blocksize']"),
]


@pytest.mark.parametrize("values,error,message", BAD_CONFIGS)
def test_bad_configs_name_the_value_and_the_fix(values, error, message):
    with pytest.raises(error) as raised:
        ZeroPPConfig.from_dict(values)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "config,world,local,message",
    [
        (dict(node_size=3), 4, 4, "node_size=3 does not divide the world size 4"),
        (dict(node_size=8), 4, 4, "node_size=8 does not divide the world size 4"),
        (dict(hpz_partition_size=4), 6, 6, "hpz_partition_size=4 must divide the world size 6"),
        (dict(hpz_partition_size=4), 8, 2, "hpz_partition_size=4 does not fit in a node of 2 ranks"),
        (dict(hpz_partition_size=16), 8, 8, "hpz_partition_size=16 must divide the world size 8"),
    ],
)
def test_bad_launch_combinations(config, world, local, message):
    with pytest.raises(ValueError) as raised:
        ZeroPPConfig(**config).resolve(world, local)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "content,suffix,message",
    [
        ("stage: [3", ".yaml", "cannot parse hf_zeropp config"),
        ("- 1\n- 2\n", ".yaml", "must hold a mapping of options"),
        ("stage: 3\nqwz: true\n", ".yaml", "unknown hf_zeropp option(s) ['qwz']"),
        (json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}), ".json",
         "zero_optimization.offload_optimizer.device='cpu' (CPU/NVMe offload) is not supported"),
        (json.dumps({"zero_optimization": {"stage": 3, "zero_quantized_magic": True}}), ".json",
         "zero_optimization.zero_quantized_magic has no hf_zeropp equivalent"),
        (json.dumps({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}), ".json",
         "DeepSpeed config key 'pipeline' cannot be mapped"),
    ],
)
def test_bad_files(tmp_path, content, suffix, message):
    path = tmp_path / f"config{suffix}"
    path.write_text(content)
    with pytest.raises(ValueError) as raised:
        ZeroPPConfig.from_file(path)
    assert message in str(raised.value)


def test_missing_file_and_bad_environment():
    with pytest.raises(FileNotFoundError, match="does not exist; check the path"):
        ZeroPPConfig.from_file("/nonexistent/zeropp.yaml")
    with pytest.raises(ValueError, match="ZEROPP_STAGES is not an hf_zeropp option"):
        ZeroPPConfig.from_env({"ZEROPP_STAGES": "3"})
    with pytest.raises(ValueError, match="ZEROPP_QUANTIZED_WEIGHTS='maybe' is not a boolean"):
        ZeroPPConfig.from_env({"ZEROPP_QUANTIZED_WEIGHTS": "maybe"})
    with pytest.raises(ValueError, match="ZEROPP_STAGE='three' is not an integer"):
        ZeroPPConfig.from_env({"ZEROPP_STAGE": "three"})
