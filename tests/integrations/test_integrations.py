"""Accelerate, Trainer and TRL integration: real launches of 4 CPU processes."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path

import background
import pytest
import torch
from paths import ROOT

from hf_zeropp.testing.spawn import run_distributed

BIN = Path(sys.executable).parent
RUN_EACH = "tests/launch_scripts/run_each.py"  # a script once per argument string, in one launch


def _launch(command: list[str], env: dict[str, str], timeout: int = 600) -> str:
    full_env = {**background.environ(), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env}
    result = background.run(command, timeout, cwd=ROOT, env=full_env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def _script(script: str, runs: tuple[str, ...]) -> list[str]:
    """What a launcher starts: ``script`` with one run's arguments, or run_each.py with several."""
    return [script, *shlex.split(runs[0])] if len(runs) == 1 else [RUN_EACH, *(f"{script} {run}" for run in runs)]


def _accelerate(output: Path, *runs: str) -> str:
    """scripts/train_accelerate.py under ``accelerate launch`` (4 processes, 2 emulated nodes), once per argument
    string, all in one launch."""
    port = str(29600 + (abs(hash(str(output))) % 300))
    return _launch([str(BIN / "accelerate"), "launch", "--config_file", "recipes/accelerate/cpu_4proc.yaml",
                    "--main_process_port", port, *_script("scripts/train_accelerate.py", runs)],
                   {"ZEROPP_NODE_SIZE": "2"})


PRESETS = ["zero1", "zero2", "zero3", "hybrid-q", "auto"]
ZEROPP_YAML = "recipes/zeropp/zeropp.yaml"


@background.launches("train_accelerate_runs")
def _accelerate_launch(work: Path) -> dict:
    zeropp_state = f"--zeropp {ZEROPP_YAML} --steps 6 --output {work / 'zeropp_state'}"
    output = _accelerate(work, *(f"--zeropp {preset} --steps 5 --output {work / preset}"
                                 for preset in ["auto", *[p for p in PRESETS if p != "auto"]]),
                         f"{zeropp_state} --save-state-at 3", f"{zeropp_state} --resume")
    return {"work": work, "output": output}


@pytest.fixture(scope="module")
def train_accelerate_runs() -> dict:
    """One launch (made in the background, tests/background.py): a 5-step run per preset (auto first, on a machine
    nothing has been measured on yet), the 6-step ZeRO++ run from a config file that saves its state after step 3,
    and the same command resuming from that state."""
    return background.result("train_accelerate_runs")


@pytest.mark.parametrize("preset", PRESETS)
def test_accelerate_launch_trains_each_stage_and_hybrid_sharding(train_accelerate_runs, preset):
    """auto probes the links at prepare, times the candidates it cannot tell apart on the first batch, and says once,
    on rank 0, which configuration it chose and why."""
    folder = train_accelerate_runs["work"] / preset
    if preset == "auto":
        from hf_zeropp.engine.auto import CANDIDATES

        output = train_accelerate_runs["output"]  # only auto's run says what auto chose
        choices = re.findall(r"^hf_zeropp auto: (.+?) \(timed on the first batch", output, re.MULTILINE)
        assert len(choices) == 1 and choices[0] in CANDIDATES, output[-3000:]
        assert "the trial took" in output and "links measured: intra-node" in output, output[-3000:]
    metrics = json.loads((folder / "metrics.json").read_text())
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.3, metrics
    assert all(m["inter_node_bytes"] > 0 for m in metrics)
    from transformers import GPT2LMHeadModel

    GPT2LMHeadModel.from_pretrained(folder / "model")  # consolidated, loadable without hf_zeropp


def test_accelerate_save_state_load_state_resumes_exactly_with_zeropp(train_accelerate_runs):
    folder = train_accelerate_runs["work"] / "zeropp_state"
    assert (folder / "state" / "zeropp_model_0" / "zeropp_meta.json").is_file()
    first = json.loads((folder / "metrics.json").read_text())
    resumed = json.loads((folder / "metrics_resumed.json").read_text())
    assert first[-1]["loss"] < first[0]["loss"]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in first[3:]]


def _torchrun(*runs: str) -> None:
    """Each command line (a script and its arguments) under torchrun (4 processes, 2 emulated nodes), all in one
    launch."""
    _launch([str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "4", RUN_EACH, *runs],
            {"ZEROPP_NODE_SIZE": "2"})


def _metrics(output: Path) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


TRAIN_GPT = ("scripts/train_gpt.py recipes/gpt350m_pile/mini/zero3.yaml --zeropp zeropp --logging_steps 2 "
             "--eval_steps 4 --max_steps 8")
LLAMA_ACCURATE = "recipes/experiments/llama_python_docs/zeropp_accurate.yaml"


@background.launches("gpt_runs")
def _gpt_launch(work: Path) -> Path:
    grpo = (f"scripts/train_grpo.py recipes/lora_rlhf/mini.yaml --max_steps 3 --logging_steps 1 --output_dir "
            f"{work / 'grpo'}")
    grpo = [grpo] if importlib.util.find_spec("trl") else []  # TRL is optional
    _torchrun(f"{TRAIN_GPT} --output_dir {work / 'full'} --save_strategy steps --save_steps 4",
              f"scripts/train_gpt.py {LLAMA_ACCURATE} --output_dir {work / 'llama'} --max_steps 6 --logging_steps 2 "
              f"--eval_steps 6",
              f"{TRAIN_GPT} --output_dir {work / 'resumed'} --resume_from_checkpoint {work / 'full' / 'checkpoint-4'}",
              *grpo)
    return work


@pytest.fixture(scope="module")
def gpt_runs() -> Path:
    """One launch (made in the background, tests/background.py): the mini recipe from the command line with ZeRO++,
    saving every 4 steps, the second accuracy case's Llama recipe, the first command again, resuming from its
    checkpoint-4, and the LoRA RLHF recipe."""
    return background.result("gpt_runs")


def test_trainer_from_the_command_line_logs_comm_and_resumes(gpt_runs):
    full = _metrics(gpt_runs / "full")
    train_logs = [m for m in full if "loss" in m]
    assert train_logs[-1]["loss"] < train_logs[0]["loss"]
    assert train_logs[0]["zeropp/bwd_allgather_inter_node_bytes"] == 0  # hpZ
    assert train_logs[0]["zeropp/qgz_inter_inter_node_bytes"] > 0  # qgZ ran
    assert 0 < train_logs[0]["zeropp/fwd_allgather_relative_error"] < 0.02  # INT8 weights
    assert any("eval_loss" in m for m in full)
    checkpoint = gpt_runs / "full" / "checkpoint-4"
    assert (checkpoint / "zeropp_optimizer" / "zeropp_meta.json").is_file()
    resumed = _metrics(gpt_runs / "resumed")
    loss_at = {m["step"]: m["loss"] for m in train_logs}
    resumed_at = {m["step"]: m["loss"] for m in resumed if "loss" in m}
    assert resumed_at[8] == pytest.approx(loss_at[8], rel=1e-6), (resumed_at, loss_at)
    from transformers import GPT2LMHeadModel

    GPT2LMHeadModel.from_pretrained(gpt_runs / "full")


def test_second_accuracy_case_runs_llama_on_python_docs_with_the_accurate_preset(gpt_runs):
    """The second accuracy case's ``base:`` recipe through the runner: a Llama on the ``python_docs`` corpus with
    ``zeropp-accurate``, whose qgZ sends an 8-bit intra-node hop (4x the bytes of the 4-bit inter-node hop with 2
    ranks per node, vs 2x with a 4-bit first hop) with the hop-1 error of 8 bits (measured after rotating back)."""
    logs = _metrics(gpt_runs / "llama")
    train_logs = [m for m in logs if "loss" in m]
    assert train_logs[-1]["loss"] < train_logs[0]["loss"]
    first = train_logs[0]
    ratio = first["zeropp/qgz_intra_intra_node_bytes"] / first["zeropp/qgz_inter_inter_node_bytes"]
    assert 3.5 < ratio < 4.5, ratio
    assert 0 < first["zeropp/qgz_intra_relative_error"] < 0.02
    assert any("eval_loss" in m for m in logs)
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(gpt_runs / "llama")
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size == 256


def test_python_docs_corpus_is_deterministic_prose_unlike_the_stdlib_code_corpus():
    """The second case's corpus must be another kind of text: code punctuation is half as frequent as in the
    standard library's source, and it is the same bytes on every call."""
    import re

    from hf_zeropp.testing.corpus import byte_sequences, python_docs_bytes, stdlib_source_bytes

    docs, code = python_docs_bytes(600_000), stdlib_source_bytes(600_000)
    assert len(docs) == 600_000 and docs == python_docs_bytes(600_000)

    def code_punctuation(text: bytes) -> float:
        return len(re.findall(rb"[()\[\]{}=_:#]", text)) / len(text)

    assert code_punctuation(docs) < 0.6 * code_punctuation(code), (code_punctuation(docs), code_punctuation(code))
    assert byte_sequences(600_000, 128, "python_docs").shape == (4687, 128)
    with pytest.raises(ValueError, match=r"unknown corpus 'pile'.*python_docs"):
        byte_sequences(1000, 8, "pile")


def _sft_run(output: str):
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel
    from trl import SFTConfig, SFTTrainer

    import hf_zeropp

    class ZeroPPSFTTrainer(hf_zeropp.ZeroPPTrainerMixin, SFTTrainer):
        pass

    from hf_zeropp.testing.corpus import stdlib_tokenizer

    tokenizer = stdlib_tokenizer(300)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                                       pad_token_id=tokenizer.pad_token_id))
    texts = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(64)]
    config_class = hf_zeropp.with_zeropp_field(SFTConfig)
    args = config_class(output_dir=output, max_steps=6, per_device_train_batch_size=4, learning_rate=3e-3,
                        logging_steps=2, save_strategy="no", report_to="none", use_cpu=True, max_length=64,
                        zeropp={"preset": "zeropp", "node_size": 1}, seed=0)
    trainer = ZeroPPSFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                               processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"logs": logs, "sharded": hasattr(trainer.model, "_zeropp")}


def test_trl_sft_trainer_with_the_mixin(tmp_path):
    pytest.importorskip("trl", reason="TRL is optional (pip install hf_zeropp[rlhf]); scripts/setup.sh installs it")
    result = run_distributed(_sft_run, 2, str(tmp_path))[0]
    assert result["sharded"]
    logs = result["logs"]
    assert logs[-1]["loss"] < logs[0]["loss"], logs
    assert logs[0]["zeropp/qgz_inter_inter_node_bytes"] > 0  # 2 nodes of 1 rank: qgZ runs its inter-node hop only
    from transformers import GPT2LMHeadModel

    GPT2LMHeadModel.from_pretrained(tmp_path)


def _scheduled_trainer_run(output: str) -> list[dict]:
    """ZeroPPTrainer with ``quantized_gradients_until: 0.5`` over 4 steps, logging every step."""
    import hf_zeropp
    from hf_zeropp.testing.tiny_models import global_batch, tiny_gpt2

    batches = torch.cat([global_batch(step, size=4) for step in range(4)])
    args = hf_zeropp.ZeroPPTrainingArguments(
        output_dir=output, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-3, logging_steps=1,
        save_strategy="no", report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0,
        zeropp={"preset": "zeropp", "node_size": 1, "quantized_gradients_until": 0.5})
    trainer = hf_zeropp.ZeroPPTrainer(model=tiny_gpt2(), args=args,
                                      train_dataset=[{"input_ids": ids, "labels": ids} for ids in batches])
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_trainer_applies_the_config_schedule(tmp_path):
    """The Trainer integration is the one entry point that runs ``*_until`` schedules (shard_model and the
    Accelerator refuse them): qgZ on for the first half of max_steps, then the plain reduce-scatter."""
    logs = run_distributed(_scheduled_trainer_run, 2, str(tmp_path))[0]
    assert [entry["step"] for entry in logs] == [1, 2, 3, 4], logs
    assert [entry["zeropp/quantized_gradients_on"] for entry in logs] == [1.0, 1.0, 0.0, 0.0], logs
    qgz_bytes = [entry.get("zeropp/qgz_inter_inter_node_bytes", 0) for entry in logs]
    assert [sent > 0 for sent in qgz_bytes] == [True, True, False, False], logs
    assert all(entry["zeropp/grad_reduce_scatter_inter_node_bytes"] > 0 for entry in logs[2:]), logs
    assert all(entry["zeropp/quantized_weights_on"] == 1.0 for entry in logs), logs


def _prepare_twice():
    import hf_zeropp
    from hf_zeropp.testing.tiny_models import tiny_gpt2

    accelerator = hf_zeropp.Accelerator(zeropp="zero3")
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    try:
        accelerator.prepare(model, optimizer)
    except ValueError as error:
        return str(error)
    return "no error"


def test_bad_inputs_of_the_integrations():
    import hf_zeropp
    coerce = hf_zeropp.ZeroPPConfig.coerce

    with pytest.raises(ValueError, match="'zerop' is neither a preset"):
        coerce("zerop", argument="zeropp")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        coerce("configs/missing.yaml", argument="zeropp")
    with pytest.raises(ValueError, match=r"unknown hf_zeropp option\(s\) \['qwz'\]"):
        coerce({"qwz": True}, argument="zeropp")
    with pytest.raises(ValueError, match="hpz_partition_size needs stage 3, but stage=2"):
        coerce({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 8}}, argument="zeropp")
    with pytest.raises(ValueError, match="neither a preset"):
        hf_zeropp.ZeroPPTrainingArguments(output_dir="/tmp/unused", zeropp="zero4")
    messages = run_distributed(_prepare_twice, 2)
    assert all("already prepared" in m for m in messages), messages


def test_grpo_lora_recipe_smoke_run(gpt_runs):
    """TRL's GRPOTrainer behind the mixin: LoRA actor, frozen INT8 base with hpZ, 2 emulated nodes x 2."""
    pytest.importorskip("trl", reason="TRL is optional (pip install hf_zeropp[rlhf]); scripts/setup.sh installs it")
    output = gpt_runs / "grpo"
    logs = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    steps = [entry for entry in logs if "reward" in entry]
    assert len(steps) == 3
    for entry in steps:
        assert entry["zeropp/frozen_allgather_inter_node_bytes"] == 0  # frozen base: node-local copy only
        assert entry["zeropp/frozen_allgather_intra_node_bytes"] > 0
        assert entry["zeropp/bwd_allgather_inter_node_bytes"] == 0
    assert (output / "adapter_config.json").is_file() and (output / "reward.png").is_file()
