"""ZeroPPConfig: constructors and every bad input, each failing with a message that names the value and the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from paths import ROOT

from hf_zeropp import PRESETS, ZeroPPConfig
from hf_zeropp.comm.topology import Topology

# the accuracy study's second cases (recipes/experiments/<case>)
STUDY_CASES = ("llama_python_docs", "llama_stdlib", "llama_tied", "opt_python_docs", "openai_gpt_python_docs",
               "gpt2_python_docs")


def test_presets_and_dict_round_trip():
    config = ZeroPPConfig.preset("zeropp", node_size=2)
    assert (config.stage, config.quantized_weights, config.hpz_partition_size, config.quantized_gradients) == (
        3, True, "node", True)
    assert ZeroPPConfig.from_dict(config.to_dict()) == config
    assert ZeroPPConfig.from_dict({"preset": "zero2", "mixed_precision": "bf16"}).stage == 2
    assert set(PRESETS) >= {"ddp", "zero1", "zero2", "zero3", "zeropp", "zeropp-accurate"}


def test_every_preset_has_its_config_file_in_recipes():
    """recipes/zeropp/<preset>.yaml is the same configuration as the preset (the files are what the docs show)."""
    folder = ROOT / "recipes" / "zeropp"
    for path in sorted(folder.glob("*.yaml")):
        assert ZeroPPConfig.from_file(path) == ZeroPPConfig.preset(path.stem), path.name
    accurate = ZeroPPConfig.preset("zeropp-accurate")
    assert (accurate.gradient_hadamard, accurate.gradient_intra_bits, accurate.gradient_bits,
            accurate.quantized_gradients, accurate.gradient_full_precision_local) == (64, 8, 4, True, True)


def test_rlhf_recipes_hold_valid_configs_and_the_full_size_one_gathers_once_per_generate_call():
    import yaml

    folder = ROOT / "recipes" / "lora_rlhf"
    configs = {path.stem: ZeroPPConfig.coerce(yaml.safe_load(path.read_text())["training"]["zeropp"])
               for path in sorted(folder.glob("*.yaml"))}
    assert set(configs) == {"mini", "qwen2.5-0.5b_gsm8k"}
    full = configs["qwen2.5-0.5b_gsm8k"]
    assert (full.quantized_nontrainable_weights, full.hpz_partition_size, full.generation_gather) == (
        True, "node", "per_call")
    with pytest.raises(ValueError, match="generation_gather"):
        ZeroPPConfig(generation_gather="per_layer")


def test_every_training_recipe_loads_to_a_valid_config_and_its_own_output_folder():
    """Each Table 5 / accuracy-study recipe (``base:`` chains resolved by the runner) holds a valid ZeroPPConfig,
    and no two recipes of a study write to the same output folder (a copied recipe that kept its base's folder
    would overwrite that run)."""

    from scripts.train_gpt import load_recipe

    for folder in ("gpt350m_pile", "gpt350m_pile/mini", "experiments/gpt350m_mini",
                   *(f"experiments/{case}" for case in STUDY_CASES)):
        paths = sorted((ROOT / "recipes" / folder).glob("*.yaml"))
        assert len(paths) >= 3, folder
        outputs = {}
        for path in paths:
            training = load_recipe(path)["training"]
            ZeroPPConfig.coerce(training["zeropp"])
            outputs.setdefault(training["output_dir"], []).append(path.name)
            assert Path(training["output_dir"]).name == path.stem, path
        assert all(len(names) == 1 for names in outputs.values()), outputs


def test_study_recipes_build_their_model_family():
    """Each accuracy case's baseline builds the family it names, with positions for its sequence length; a misspelt
    family stops with its name."""

    from scripts.train_gpt import build_model, load_recipe

    for folder in ("gpt350m_pile/mini", *(f"experiments/{case}" for case in STUDY_CASES if case != "llama_stdlib")):
        recipe = load_recipe(ROOT / "recipes" / folder / "zero3.yaml")
        seq_len = int(recipe["data"]["seq_len"])
        model = build_model(recipe["model"], 256, seq_len)
        assert model.config.model_type == recipe["model"].get("family", "gpt2"), folder
        assert model.config.max_position_embeddings == seq_len
        assert model.config.tie_word_embeddings == (folder != "experiments/llama_python_docs"), folder
        named = ZeroPPConfig.coerce(recipe["training"]["zeropp"]).wrap_modules or model._no_split_modules
        assert any(type(m).__name__ in named for m in model.modules()), f"{folder}: no layer becomes an FSDP unit"
    with pytest.raises(SystemExit, match="model family 'gtp2' is not a transformers model type"):
        build_model({"family": "gtp2"}, 256, 128)


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


def test_topology_from_config_fills_in_node_and_hpz_sizes():
    topology = Topology.from_config(ZeroPPConfig.preset("zeropp"), 8, local_world_size=4)
    assert (topology.node_size, topology.hpz_size, topology.nodes) == (4, 4, 2)
    assert (topology.rank, topology.device_type, topology.node_size_source) == (0, "cpu", "given")
    topology = Topology.from_config(ZeroPPConfig(stage=3, node_size=2), 8, rank=5, local_world_size=8)
    assert (topology.node_size, topology.hpz_size, topology.node, topology.local_rank) == (2, 1, 2, 1)
    assert topology.node_size_source == "node_size in the hf_zeropp config"


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
    (dict(gradient_error_feedback=True, gradient_error_feedback_decay=1), ValueError,
     "gradient_error_feedback_decay=1.0 must be in [0, 1)"),
    (dict(gradient_error_feedback=True, gradient_error_feedback_reset=-1), ValueError,
     "gradient_error_feedback_reset=-1 must be >= 0 (0 = never reset)"),
    (dict(gradient_error_feedback_decay=0.5), ValueError,
     "gradient_error_feedback_decay=0.5 tune error feedback, which is off; set gradient_error_feedback: true"),
    (dict(gradient_bit_allocation_floor=2), ValueError,
     "gradient_bit_allocation_floor=2 bounds per-block widths, which are off; set gradient_bit_allocation: true"),
    (dict(gradient_bit_allocation=True, gradient_bit_allocation_floor=1), ValueError,
     "gradient_bit_allocation_floor=1 must be 0 (no floor) or a width from 2 to gradient_bits=4"),
    (dict(gradient_bit_allocation=True, gradient_bit_allocation_floor=5), ValueError,
     "gradient_bit_allocation_floor=5 must be 0 (no floor) or a width from 2 to gradient_bits=4"),
    (dict(weight_deltas=True), ValueError,
     "weight_deltas sends qwZ's forward gather as differences, but quantized_weights is off; set quantized_weights"),
    (dict(preset="zeropp-deltas", shard_group="node"), ValueError, "shard_group='node' (hybrid sharding) with "
                                                                   "quantized_weights"),
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
        Topology.from_config(ZeroPPConfig(**config), world, local_world_size=local)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    "content,suffix,message",
    [
        ("stage: [3", ".yaml", "cannot parse hf_zeropp config"),
        ("- 1\n- 2\n", ".yaml", "must hold a mapping of options"),
        ("stage: 3\nqwz: true\n", ".yaml", "unknown hf_zeropp option(s) ['qwz']"),
        (json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}), ".json",
         "zero_optimization.offload_optimizer.device='nvme' (NVMe offload) is not supported"),
        (json.dumps({"zero_optimization": {"stage": 3, "zero_quantized_magic": True}}), ".json",
         "zero_optimization.zero_quantized_magic has no hf_zeropp equivalent"),
        (json.dumps({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}), ".json",
         "DeepSpeed config key 'pipeline' (pipeline parallelism; hf_zeropp is data parallel (ZeRO)) cannot be mapped"),
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


def test_enumerations_are_literal_annotations_checked_by_one_routine():
    """Every enumeration is a ``Literal`` annotation; the one validation routine names field, value and choices."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(ZeroPPConfig)
    def literal(hint) -> bool:
        return typing.get_origin(hint) is typing.Literal or any(literal(a) for a in typing.get_args(hint))

    enumerations = {f.name for f in dataclasses.fields(ZeroPPConfig) if literal(hints[f.name])}
    assert enumerations == {"stage", "mixed_precision", "reduce_dtype", "generation_gather", "weight_bits",
                            "hpz_partition_size", "shard_group", "hybrid_gradient_bits", "gradient_bits",
                            "gradient_intra_bits", "kernel_backend", "persistence_threshold", "prefetch_bucket_size"}
    for name, bad, allowed in [("stage", 7, "0 (data parallel), 1, 2 or 3"), ("gradient_bits", 16, "8 or 4"),
                               ("reduce_dtype", "fp8", "one of ('fp32', 'bf16', 'fp16')"),
                               ("kernel_backend", "triton", "one of ('reference', 'cpp', 'cuda') or None"),
                               ("hpz_partition_size", "rack", "an integer or 'node'"),
                               ("shard_group", "rack", "one of ('world', 'node', 'auto')")]:
        with pytest.raises(ValueError) as raised:
            ZeroPPConfig(**{name: bad})
        assert f"{name}={bad!r}" in str(raised.value) and allowed in str(raised.value), str(raised.value)


def test_readme_option_table_matches_the_field_docs_and_defaults():
    """README's ``ZeroPPConfig`` table is ``option_table()``: every field with its default and doc, and no row for
    an option that does not exist."""
    import dataclasses
    import re

    from hf_zeropp.config.config import option_table
    from hf_zeropp.config.field_types import render_default

    readme = (ROOT / "README.md").read_text()
    start = readme.index("| option | default | meaning |")
    table = readme[start:].split("\n\n", 1)[0].strip()
    rows = {}
    for line in table.splitlines():
        match = re.fullmatch(r"\| `(\w+)` \| (.*?) \| (.*) \|", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    options = {f.name: f for f in dataclasses.fields(ZeroPPConfig) if f.name != "extra"}
    assert not set(rows) - set(options), f"README rows for options that do not exist: {sorted(set(rows) - set(options))}"
    assert not set(options) - set(rows), f"options missing from the README table: {sorted(set(options) - set(rows))}"
    for name, f in options.items():
        assert f.metadata.get("doc"), f"{name} has no doc"
        assert rows[name] == (render_default(f.default), f.metadata["doc"]), name
    assert table == option_table(), "regenerate the README table with hf_zeropp.config.config.option_table()"


def test_options_grouped_in_sections_equal_flat_ones(tmp_path):
    """A config file may group its options under the option table's section keys; flat keys keep working, and an
    option under another section's key, or given twice, is an error that names where it belongs."""
    grouped = tmp_path / "grouped.yaml"
    grouped.write_text("zeropp:\n  sharding: {stage: 3, mixed_precision: bf16}\n  weights: {quantized_weights: true}\n"
                       "  hpz: {hpz_partition_size: node}\n  gradients: {quantized_gradients: true}\n"
                       "  accuracy: {gradient_hadamard: 64, gradient_intra_bits: 8}\n  launch: {node_size: 2}\n")
    flat = ZeroPPConfig(stage=3, mixed_precision="bf16", quantized_weights=True, hpz_partition_size="node",
                        quantized_gradients=True, gradient_hadamard=64, gradient_intra_bits=8, node_size=2)
    assert ZeroPPConfig.from_file(grouped) == flat
    assert ZeroPPConfig.from_dict({"preset": "zeropp", "accuracy": {"gradient_intra_bits": 8}}) == \
        ZeroPPConfig.preset("zeropp", gradient_intra_bits=8)
    with pytest.raises(ValueError, match="gradient_hadamard belongs under accuracy:, not under gradients:"):
        ZeroPPConfig.from_dict({"gradients": {"gradient_hadamard": 64}})
    with pytest.raises(ValueError, match="stage is given twice"):
        ZeroPPConfig.from_dict({"stage": 3, "sharding": {"stage": 2}})
    with pytest.raises(ValueError, match=r"unknown hf_zeropp option\(s\) \['qgz'\]"):
        ZeroPPConfig.from_dict({"gradients": {"qgz": True}})
