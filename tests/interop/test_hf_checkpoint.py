"""Hugging Face safetensors folders read and written per rank (docs/large-models.md): every rank's shards equal
the checkpoint's tensors, frozen INT8 stores equal those quantized from rank 0's full copy, saved folders load with
plain transformers and hold the tensors stock ``save_pretrained`` writes, and bad folders fail on every rank with
the file and tensor named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import VOCAB, full_parameters

PRESETS = {"zero3": {"stage": 3}, "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node",
                                             "quantized_gradients": True}}


def _models():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    return {
        "gpt2_tied": GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                                bos_token_id=0, eos_token_id=0)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                              max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
                                              pad_token_id=0, tie_word_embeddings=False)),
    }


def _saved(directory: Path) -> dict[str, str]:
    """Each model saved once as one file and once split into several (an index and 3+ files)."""
    paths = {}
    for family, model in _models().items():
        for layout, size in (("single", "50GB"), ("split", "20KB")):
            path = directory / f"{family}_{layout}"
            model.save_pretrained(path, max_shard_size=size)
            paths[f"{family}_{layout}"] = str(path)
    assert (Path(paths["llama_split"]) / "model.safetensors.index.json").is_file()
    return paths


def _load_every_way(paths: dict[str, str]) -> dict:
    from transformers import AutoModelForCausalLM

    import hf_zeropp

    results = {}
    for name, path in paths.items():
        plain = AutoModelForCausalLM.from_pretrained(path)
        for preset, options in PRESETS.items():
            for dtype in (torch.float32, torch.bfloat16):
                model = hf_zeropp.from_pretrained(AutoModelForCausalLM, path, dtype=dtype)
                on_meta = all(p.is_meta for p in model.parameters())
                hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**options, node_size=2))
                got = full_parameters(model)
                results[(name, preset, str(dtype))] = {
                    "on_meta_before": on_meta,
                    "dtypes": {str(p.dtype) for p in model.parameters()},
                    "exact": all(torch.equal(got[n], p.detach().to(dtype).float())
                                 for n, p in plain.named_parameters()),
                    "buffers_equal": all(torch.equal(b, dict(plain.named_buffers())[n])
                                         for n, b in model.named_buffers()),
                    "loading": hf_zeropp.comm_stats(model)["implementations"].get("loading", ""),
                }
    return results


def test_every_rank_reads_exactly_the_checkpoints_tensors(tmp_path):
    """zero3 and ZeRO++ (hpZ), tied GPT-2 and Llama (rotary buffers), one file and an index of several, fp32 and
    a bf16 cast: every rank starts on the meta device and its shards are the checkpoint's tensors, bit for bit."""
    paths = _saved(tmp_path)
    for rank_result in run_distributed(_load_every_way, 4, paths, node_size=2):
        for key, result in rank_result.items():
            assert result["on_meta_before"] and result["exact"] and result["buffers_equal"], (key, result)
            assert result["dtypes"] == {key[2]}, (key, result)
            assert "each rank reads its own slices" in str(result["loading"]), (key, result)


def _empty(path: str):
    """The model at ``path`` without memory, the way Accelerate documents it: its class from the config under the
    meta device (``from_pretrained(device_map="meta")`` is refused since transformers 5.25)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def _frozen_both_ways(path: str) -> dict:
    """LoRA with frozen INT8 base weights: the stores read per rank against the stores quantized from rank 0's
    full copy (the placement rank 0 reaches when it alone loads)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import hf_zeropp
    from hf_zeropp.engine.frozen import frozen_stores

    config = hf_zeropp.ZeroPPConfig(**PRESETS["zeropp"], node_size=2, quantized_nontrainable_weights=True)
    lora = {"r": 4, "target_modules": ["c_attn", "c_fc"], "lora_dropout": 0.0}
    stores = {}
    for way in ("per_rank", "rank0"):
        if way == "per_rank":
            base = hf_zeropp.from_pretrained(AutoModelForCausalLM, path)
        else:
            base = AutoModelForCausalLM.from_pretrained(path) if dist.get_rank() == 0 else _empty(path)
        model = get_peft_model(base, LoraConfig(**lora))
        hf_zeropp.shard_model(model, config)
        stores[way] = {name: (store.codes.clone(), store.scales.clone()) for name, store in frozen_stores(model).items()}
        adapters = {n: p for n, p in full_parameters(model).items() if "lora_" in n}
        stores[f"{way}_adapters"] = adapters
    same = all(torch.equal(stores["per_rank"][n][0], codes) and torch.equal(stores["per_rank"][n][1], scales)
               for n, (codes, scales) in stores["rank0"].items())
    adapters = stores["per_rank_adapters"]
    return {"stores": len(stores["rank0"]), "same_keys": stores["per_rank"].keys() == stores["rank0"].keys(),
            "bit_identical": same,
            "lora_b_zero": all(float(p.abs().max()) == 0 for n, p in adapters.items() if "lora_B" in n),
            "lora_a_set": all(float(p.abs().max()) > 0 for n, p in adapters.items() if "lora_A" in n),
            "adapters": {n: p for n, p in adapters.items() if "lora_A" in n}}


def test_frozen_int8_stores_read_per_rank_equal_those_quantized_from_rank_0(tmp_path):
    """zeropp with LoRA on top and frozen INT8 base weights: each rank quantizes only its own rows, and its codes
    and scales are those of the rank-0 path, bit for bit; the adapters get peft's init, the same on every rank."""
    paths = _saved(tmp_path)
    results = run_distributed(_frozen_both_ways, 4, paths["gpt2_tied_split"], node_size=2)
    for result in results:
        assert result["stores"] >= 6 and result["same_keys"] and result["bit_identical"], result
        assert result["lora_b_zero"] and result["lora_a_set"], result
    for name, value in results[0]["adapters"].items():
        assert all(torch.equal(value, other["adapters"][name]) for other in results[1:]), name


def _save_every_way(paths: dict[str, str], out: str) -> None:
    from transformers import AutoModelForCausalLM

    import hf_zeropp

    for name in ("gpt2_tied_single", "llama_single"):
        model = hf_zeropp.from_pretrained(AutoModelForCausalLM, paths[name])
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**PRESETS["zeropp"], node_size=2))
        for layout, size in (("single", "50GB"), ("split", "20KB")):
            model.save_pretrained(f"{out}/{name}_{layout}", max_shard_size=size)
        hf_zeropp.save_pretrained(model, f"{out}/{name}_atomic")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_saved_folders_hold_the_tensors_stock_writes_and_load_with_plain_transformers(tmp_path):
    """Every rank writes its slices; the folder has the names, shapes and values of stock ``save_pretrained`` (the
    tied matrix once), one file or an index of several, and loads with plain transformers to the same tensors."""
    from transformers import AutoModelForCausalLM

    paths = _saved(tmp_path)
    out = tmp_path / "saved"
    run_distributed(_save_every_way, 4, paths, str(out), node_size=2)
    for name in ("gpt2_tied_single", "llama_single"):
        stock = _tensors(Path(paths[name]))
        for layout in ("single", "split", "atomic"):
            folder = out / f"{name}_{layout}"
            assert not (folder / ".zeropp-weights.partial").exists()
            assert (folder / "model.safetensors.index.json").is_file() == (layout == "split"), folder
            if layout == "split":
                index = json.loads((folder / "model.safetensors.index.json").read_text())
                assert set(index["weight_map"]) == set(stock) and len(set(index["weight_map"].values())) >= 3
            saved = _tensors(folder)
            assert saved.keys() == stock.keys(), (layout, saved.keys() ^ stock.keys())
            assert all(torch.equal(saved[key], stock[key]) for key in stock), (name, layout)
            reloaded = AutoModelForCausalLM.from_pretrained(folder)
            original = AutoModelForCausalLM.from_pretrained(paths[name])
            assert all(torch.equal(p, dict(original.named_parameters())[n]) for n, p in reloaded.named_parameters())


# ------------------------------------------------------------------------------------------------ bad input


def _load_error(path: str) -> str:
    from transformers import AutoModelForCausalLM

    import hf_zeropp

    try:
        model = hf_zeropp.from_pretrained(AutoModelForCausalLM, path)
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(stage=3, node_size=2))
    except (ValueError, FileNotFoundError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _broken(tmp_path: Path, case: str) -> Path:
    paths = _saved(tmp_path)
    if case == "missing_shard":
        folder = Path(paths["llama_split"])
        victim = sorted(folder.glob("model-*.safetensors"))[1]
        victim.unlink()
        return folder
    if case == "truncated":
        folder = Path(paths["llama_single"])
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) - 1000])
        return folder
    if case == "wrong_shape":
        folder = Path(paths["llama_single"])
        tensors = load_file(folder / "model.safetensors")
        tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(40, 32)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        return folder
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "config.json").write_text((Path(paths["llama_single"]) / "config.json").read_text())
    return folder


@pytest.mark.parametrize("case, expected", [
    ("missing_shard", ["model-00002-of-", "does not exist"]),
    ("truncated", ["model.safetensors", "truncated"]),
    ("wrong_shape", ["model.layers.1.mlp.up_proj.weight", "(48, 32)", "(40, 32)"]),
    ("no_weights", ["empty"]),
])
def test_a_bad_folder_fails_on_every_rank_naming_the_file_and_the_tensor(tmp_path, case, expected):
    folder = _broken(tmp_path, case)
    messages = run_distributed(_load_error, 4, str(folder), node_size=2)
    for message in messages:
        assert all(part in message for part in expected), (case, message)
    assert len(set(messages)) == 1, messages


def _save_then_fail(path: str, target: str) -> dict:
    from transformers import AutoModelForCausalLM

    import hf_zeropp
    import hf_zeropp.interop.hf_checkpoint as hf_checkpoint

    model = hf_zeropp.from_pretrained(AutoModelForCausalLM, path)
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(stage=3, node_size=2))
    model.save_pretrained(target)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    write = hf_checkpoint._OutputFile.write_own_rows

    def fill_the_disk(self, folder, state):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return write(self, folder, state)

    hf_checkpoint._OutputFile.write_own_rows = fill_the_disk
    try:
        model.save_pretrained(target)
        return {"error": "no error"}
    except OSError as error:
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        hf_checkpoint._OutputFile.write_own_rows = write


def test_a_save_that_fails_midway_fails_on_every_rank_and_leaves_the_previous_weights(tmp_path):
    """Rank 1's disk fills while it writes: every rank raises (none hangs), and the folder still holds the
    previous save's weights, which load with plain transformers."""
    from transformers import AutoModelForCausalLM

    paths = _saved(tmp_path)
    target = tmp_path / "target"
    results = run_distributed(_save_then_fail, 4, paths["llama_single"], str(target), node_size=2)
    for result in results:
        assert "No space left on device" in result["error"], result
    reloaded = AutoModelForCausalLM.from_pretrained(target)
    original = AutoModelForCausalLM.from_pretrained(paths["llama_single"])
    assert all(torch.equal(p, dict(original.named_parameters())[n]) for n, p in reloaded.named_parameters())


# ------------------------------------------------------------------------------------------------ the Trainer


def _trainer_run(path: str, out: str, resume: str | None, loaded: str) -> dict:
    """4 ZeroPPTrainer steps from ``path`` (``loaded``: ``slices`` = hf_zeropp.from_pretrained, ``full`` = every rank
    loads it, as stock), saving and evaluating every 2 steps, best model loaded at the end."""
    from transformers import AutoModelForCausalLM, TrainerCallback

    import hf_zeropp

    losses = {}

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses[state.global_step] = logs["loss"]

    model = (hf_zeropp.from_pretrained(AutoModelForCausalLM, path) if loaded == "slices"
             else AutoModelForCausalLM.from_pretrained(path))
    ids = torch.randint(0, VOCAB, (32, 16), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = hf_zeropp.ZeroPPTrainingArguments(
        output_dir=out, max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2, logging_steps=1,
        save_strategy="steps", save_steps=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
        metric_for_best_model="loss", report_to="none", use_cpu=True, seed=0, zeropp={"stage": 3, "node_size": 2})
    trainer = hf_zeropp.ZeroPPTrainer(model=model, args=args, train_dataset=dataset, eval_dataset=dataset[:8],
                                      callbacks=[Record()])
    trainer.train(resume_from_checkpoint=resume)
    return {"losses": losses, "best": trainer.state.best_model_checkpoint,
            "final": full_parameters(trainer.model)}


def test_trainer_resume_and_best_model_read_the_checkpoint_in_slices(tmp_path):
    """A Trainer run on a model loaded in slices, resumed from its checkpoint-2 twice: once loaded in slices again
    (the checkpoint's weights replace the pretrained ones before sharding), once loaded in full on every rank as
    stock does. Both log the uninterrupted run's losses for steps 3 and 4; load_best_model_at_end leaves exactly the
    best checkpoint's tensors."""
    paths = _saved(tmp_path)
    out = str(tmp_path / "run")
    first = run_distributed(_trainer_run, 4, paths["gpt2_tied_single"], out, None, "slices", node_size=2)[0]
    assert sorted(first["losses"]) == [1, 2, 3, 4], first["losses"]
    best = _tensors(Path(first["best"]))
    assert all(torch.equal(first["final"][name], value) for name, value in best.items()), first["best"]
    for loaded in ("slices", "full"):
        resumed = run_distributed(_trainer_run, 4, paths["gpt2_tied_single"], str(tmp_path / f"resumed_{loaded}"),
                                  f"{out}/checkpoint-2", loaded, node_size=2)[0]
        assert sorted(resumed["losses"]) == [3, 4], (loaded, resumed["losses"])
        for step in (3, 4):
            assert abs(resumed["losses"][step] - first["losses"][step]) <= 1e-6 * first["losses"][step], (
                loaded, step, resumed["losses"], first["losses"])
