"""The patterns the conformance suite (tests/conformance/test_conformance.py) runs once under stock Accelerate /
Trainer / TRL and once under hf_zeropp, and ``scripts/conformance_table.py`` prints side by side. Each pattern function
runs on every rank of one launch (:func:`hf_zeropp.testing.spawn.run_distributed`) for one mode — ``"stock"`` or an
hf_zeropp preset — and returns what the suite compares: losses, gradient norms, state dicts, saved files' tensors,
logits of the saved models reloaded with plain transformers."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hf_zeropp.testing.tiny_models import VOCAB, tiny_gpt2

WORLD, NODE_SIZE = 4, 2  # one launch: 2 emulated nodes x 2 ranks


def _batch(step: int, micro: int, rank: int, size: int = 2) -> torch.Tensor:
    """This rank's micro-batch, the same under every mode: counting sequences from random starts (learnable)."""
    seed = 10_000 + 100 * step + 10 * micro + rank
    starts = torch.randint(0, VOCAB, (size, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(16)) % VOCAB


def _accelerator(mode: str, **kwargs):
    import accelerate
    from accelerate.state import AcceleratorState, GradientState

    import hf_zeropp

    AcceleratorState._reset_state(True)  # one fresh Accelerator per pattern, as separate scripts would have
    GradientState._reset_state()
    os.environ["ACCELERATE_USE_CPU"] = "true"
    if mode == "stock":
        return accelerate.Accelerator(**kwargs)
    return hf_zeropp.Accelerator(zeropp=hf_zeropp.ZeroPPConfig.preset(mode, node_size=NODE_SIZE), **kwargs)


def _train_steps(accelerator, model, optimizer, steps: range, scheduler=None, micro_batches: int = 2,
                 clip: float | None = 1.0) -> dict[str, list[float]]:
    """Accelerate's canonical loop: accumulate, backward, clip at the sync step, step, zero_grad."""
    record: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for step in steps:
        for micro in range(micro_batches):
            ids = _batch(step, micro, accelerator.process_index)
            with accelerator.accumulate(model):
                loss = model(input_ids=ids, labels=ids).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and clip is not None:
                    record["grad_norm"].append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
                optimizer.zero_grad()
        record["loss"].append(accelerator.gather_for_metrics(loss.detach().reshape(1)).mean().item())
    return record


def _logits(model_dir: Path) -> torch.Tensor:
    """Logits of a checkpoint reloaded with plain transformers (no hf_zeropp). Stock ``accelerator.save_model``
    writes weights only: its users write the config beside them, as done here."""
    from transformers import GPT2LMHeadModel

    if not (model_dir / "config.json").is_file():
        tiny_gpt2().config.save_pretrained(model_dir)
    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(input_ids=_batch(99, 0, 0, size=4)).logits


def _saved_tensor_names(folder: Path) -> list[str]:
    from safetensors import safe_open

    names = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as tensors:
            names += tensors.keys()
    return sorted(names)


def _one_call_prepare(mode: str, workdir: Path) -> dict:
    """prepare(model, optimizer, loader, scheduler) in one call; accumulation, clipping, gather_for_metrics over an
    uneven evaluation set; the state dict and four ways of saving a model; load_state_dict of full tensors."""
    from torch.utils.data import DataLoader

    accelerator = _accelerator(mode, gradient_accumulation_steps=2)
    model = tiny_gpt2()
    initial = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    evaluation = DataLoader(list(range(11)), batch_size=2)  # 11 samples over 4 ranks: the last batch is padded
    model, optimizer, scheduler, evaluation = accelerator.prepare(model, optimizer, scheduler, evaluation)
    result = _train_steps(accelerator, model, optimizer, range(3), scheduler)
    seen = torch.cat([accelerator.gather_for_metrics(batch) for batch in evaluation])
    result["evaluated_samples"] = sorted(seen.tolist())
    result["state_dict"] = {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}

    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(workdir / "no_state_dict", is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save)
    unwrapped.save_pretrained(workdir / "with_state_dict", is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=accelerator.get_state_dict(model))
    unwrapped.save_pretrained(workdir / "with_own_state_dict", is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save, state_dict=unwrapped.state_dict())
    accelerator.save_model(model, workdir / "save_model")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        saved = ("no_state_dict", "with_state_dict", "with_own_state_dict", "save_model")
        result["reloaded_logits"] = {name: _logits(workdir / name) for name in saved}
        result["saved_tensors"] = {name: _saved_tensor_names(workdir / name) for name in saved}

    unwrapped.load_state_dict(initial)  # full tensors into a trained (sharded) model
    with torch.no_grad():
        ids = _batch(99, 0, 0)
        result["loss_after_loading_initial_weights"] = float(model(input_ids=ids, labels=ids).loss)
    return result


def _split_prepare(mode: str) -> dict:
    """The optimizer is built on the unprepared model, then model and optimizer are prepared in separate calls."""
    accelerator = _accelerator(mode, gradient_accumulation_steps=2)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    model = accelerator.prepare(model)
    optimizer = accelerator.prepare(optimizer)
    return _train_steps(accelerator, model, optimizer, range(3))


def _fsdp2_order_with_resume(mode: str, workdir: Path) -> dict:
    """FSDP2's order: prepare the model, build the optimizer on the prepared model, prepare it in a later call;
    save_state after 2 steps, train 2 more; a fresh run (other initial weights) load_states and trains the same 2."""
    def build(seed: int):
        accelerator = _accelerator(mode, gradient_accumulation_steps=2)
        model = accelerator.prepare(tiny_gpt2(seed=seed))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
        return accelerator, model, optimizer, scheduler

    accelerator, model, optimizer, scheduler = build(seed=0)
    first = _train_steps(accelerator, model, optimizer, range(2), scheduler)
    accelerator.save_state(str(workdir / "state"))
    uninterrupted = _train_steps(accelerator, model, optimizer, range(2, 4), scheduler)
    accelerator, model, optimizer, scheduler = build(seed=1)
    accelerator.load_state(str(workdir / "state"))
    resumed = _train_steps(accelerator, model, optimizer, range(2, 4), scheduler)
    return {"loss": first["loss"] + uninterrupted["loss"], "resumed_loss": resumed["loss"],
            "uninterrupted_loss": uninterrupted["loss"]}


def _compiled(mode: str, workdir: Path) -> dict:
    """Accelerate's dynamo settings (what ``--dynamo_backend``, an Accelerate YAML's ``dynamo_config`` and the
    Trainer's ``--torch_compile`` set), regional: stock compiles the DDP model's blocks and other leaves, hf_zeropp each
    FSDP unit. The backend ``eager`` runs the traced graphs as eager does (the cheapest compile: ``aot_eager``, which
    also traces the backward, runs in the Trainer pattern and tests/engine/test_compile.py), so the numbers must be eager's.
    Accumulation (``no_sync``), clipping, and save_state / load_state of the compiled model; dynamo's counters:
    graph breaks, and graphs compiled by the end of the first step and of the run (after the resume)."""
    from accelerate.utils import TorchDynamoPlugin
    from torch._dynamo.utils import counters

    import hf_zeropp

    torch._dynamo.reset()
    counters.clear()
    plugin = TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
    accelerator = _accelerator(mode, gradient_accumulation_steps=2, dynamo_plugin=plugin)
    model = tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    model, optimizer = accelerator.prepare(model, optimizer)
    result = _train_steps(accelerator, model, optimizer, range(1))
    graphs_after_first_step = counters["stats"]["unique_graphs"]
    accelerator.save_state(str(workdir / "state"))
    uninterrupted = _train_steps(accelerator, model, optimizer, range(1, 3))
    accelerator.load_state(str(workdir / "state"))
    resumed = _train_steps(accelerator, model, optimizer, range(1, 3))
    implementations = {} if mode == "stock" else hf_zeropp.comm_stats(model)["implementations"]
    return {"loss": result["loss"] + uninterrupted["loss"],
            "grad_norm": result["grad_norm"] + uninterrupted["grad_norm"], "resumed_loss": resumed["loss"], "uninterrupted_loss": uninterrupted["loss"],
            "graph_breaks": sum(counters["graph_break"].values()),
            "graphs": (graphs_after_first_step, counters["stats"]["unique_graphs"]),
            "compile": implementations.get("compile"), "model_class": type(model).__name__}


# The modes the compiled pattern runs in: every mode of the suite (stage 0 compiled is in tests/engine/test_compile.py)
COMPILED_MODES = ("stock", "zero1", "zero2", "zero3", "hybrid", "zeropp", "hybrid-q")


def accelerate_patterns(mode: str, workdir: str) -> dict:
    workdir = Path(workdir) / mode
    patterns = {"one_call": _one_call_prepare(mode, workdir / "one_call"),
                "split_prepare": _split_prepare(mode),
                "fsdp2_order": _fsdp2_order_with_resume(mode, workdir / "fsdp2_order")}
    if mode in COMPILED_MODES:
        patterns["compiled"] = _compiled(mode, workdir / "compiled")
    return patterns


def _sequences(count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    starts = torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(16)) % VOCAB for s in starts)]


def _trainer(mode: str, output_dir: Path, **arguments):
    from transformers import Trainer, TrainingArguments

    import hf_zeropp

    options = dict(output_dir=str(output_dir), max_steps=6, per_device_train_batch_size=2,
                   gradient_accumulation_steps=2, learning_rate=1e-2, adam_epsilon=1e-6, max_grad_norm=1.0,
                   eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, logging_steps=1,
                   load_best_model_at_end=True, metric_for_best_model="eval_loss", report_to="none", use_cpu=True,
                   seed=0, greater_is_better=True,  # "best" = highest loss: an early checkpoint, not the last one
                   **arguments)
    data = {"train_dataset": _sequences(64, seed=1), "eval_dataset": _sequences(8, seed=2)}
    if mode == "stock":
        return Trainer(model=tiny_gpt2(), args=TrainingArguments(**options), **data)
    args = hf_zeropp.ZeroPPTrainingArguments(zeropp={"preset": mode, "node_size": NODE_SIZE}, **options)
    return hf_zeropp.ZeroPPTrainer(model=tiny_gpt2(), args=args, **data)


def _trainer_summary(trainer, output_dir: Path, first_step: int = 0) -> dict:
    """Training and evaluation logs after ``first_step``, the best checkpoint, the evaluation of the model train()
    left (the best one, reloaded), and the logits of ``save_model``'s folder and of the best checkpoint reloaded
    with plain transformers."""
    import torch.distributed as dist

    logs = [e for e in trainer.state.log_history if e["step"] > first_step]
    result = {"loss": [e["loss"] for e in logs if "loss" in e],
              "grad_norm": [e["grad_norm"] for e in logs if "grad_norm" in e],
              "eval_loss": {e["step"]: e["eval_loss"] for e in logs if "eval_loss" in e},
              "best_checkpoint": Path(trainer.state.best_model_checkpoint or "").name,
              "final_eval_loss": trainer.evaluate()["eval_loss"]}
    trainer.save_model(str(output_dir / "final"))
    dist.barrier()
    if dist.get_rank() == 0:
        result["reloaded_logits"] = _logits(output_dir / "final")
        result["best_checkpoint_logits"] = _logits(Path(trainer.state.best_model_checkpoint))
        result["saved_tensors"] = _saved_tensor_names(output_dir / "final")
    return result


def trainer_patterns(mode: str, workdir: str) -> dict:
    """Trainer with evaluation, checkpoints every 2 steps, load_best_model_at_end and save_model."""
    output_dir = Path(workdir) / mode
    trainer = _trainer(mode, output_dir)
    trainer.train()
    return _trainer_summary(trainer, output_dir)


def trainer_resume_on_two_ranks(mode: str, workdir: str) -> dict:
    """resume_from_checkpoint of a checkpoint written by 4 ranks, on 2 (DCP reshards hf_zeropp's optimizer). Under
    hf_zeropp the resumed run is compiled (``--torch_compile_backend aot_eager``: eager's arithmetic, so stock's
    uncompiled numbers stay the reference; the Accelerate patterns compare with stock compiled)."""
    import hf_zeropp

    output_dir = Path(workdir) / f"{mode}_resumed"
    trainer = _trainer(mode, output_dir, **({} if mode == "stock" else {"torch_compile_backend": "aot_eager"}))
    trainer.train(resume_from_checkpoint=str(Path(workdir) / mode / "checkpoint-2"))
    summary = _trainer_summary(trainer, output_dir, first_step=2)
    if mode != "stock":
        summary["compile"] = hf_zeropp.comm_stats(trainer.model)["implementations"].get("compile")
    return summary


def _digit_reward(completions: list[str], **_) -> list[float]:
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def _per_rank_bytes(model) -> int:
    """Bytes this rank holds for a model between steps: its parameters (shards and INT8-stored frozen weights under
    hf_zeropp) and the gathered weights FSDP keeps (hpZ's node-local secondary shard after a forward)."""
    import hf_zeropp

    if not hasattr(model, "_zeropp"):
        return sum(t.numel() * t.element_size() for t in model.parameters())
    return hf_zeropp.state_bytes(model)["parameters"] + hf_zeropp.gathered_parameter_bytes(model)


def _trl_trainer(kind: str, mode: str, base: Path, output_dir: Path):
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

    import hf_zeropp

    # bf16=False: TRL defaults to bf16, where stock Accelerate autocasts and hf_zeropp casts the weights
    # (docs/design.md, "Differences from stock"); the exact comparison is made in fp32
    common = dict(output_dir=str(output_dir), per_device_train_batch_size=2, learning_rate=1e-3, adam_epsilon=1e-6,
                  bf16=False, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0)
    if kind == "sft":
        trainer_class, config_class = SFTTrainer, SFTConfig
        options = dict(max_steps=3, max_length=32)
        data = {"train_dataset": Dataset.from_dict(
            {"text": [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(32)]})}
    elif kind == "dpo":
        trainer_class, config_class = DPOTrainer, DPOConfig
        options = dict(max_steps=3, max_length=32, beta=0.1)
        data = {"train_dataset": Dataset.from_dict({
            "prompt": [f"x{i} =" for i in range(32)], "chosen": [f" {i * 7}" for i in range(32)],
            "rejected": [" none" for _ in range(32)]})}
    else:
        trainer_class, config_class = GRPOTrainer, GRPOConfig
        options = dict(max_steps=2, beta=0.1, num_generations=4, max_completion_length=8, temperature=1.0)
        if mode == COMPILED_TRL_MODE:  # its generation and training on the compiled units; eager's arithmetic
            options["torch_compile_backend"] = "eager"
        data = {"train_dataset": Dataset.from_dict({"prompt": [f"Value {i}:" for i in range(32)]}),
                "reward_funcs": _digit_reward}
    if mode != "stock":
        trainer_class = type(f"ZeroPP{trainer_class.__name__}", (hf_zeropp.ZeroPPTrainerMixin, trainer_class), {})
        config_class = hf_zeropp.with_zeropp_field(config_class)
        options["zeropp"] = {"preset": mode, "node_size": NODE_SIZE}
    return trainer_class(model=str(base), args=config_class(**common, **options), **data)


# The mode whose GRPO run compiles its model (the Trainer's --torch_compile_backend eager: dynamo's graphs, run as eager
# runs them; aot_eager costs twice the CPU here): generation and training through the compiled units, against stock's
# uncompiled run
COMPILED_TRL_MODE = "zero3"


def trl_patterns(mode: str, workdir: str) -> dict:
    """SFT, DPO and GRPO (beta > 0, so both build a reference model) with full fine-tuning."""
    import hf_zeropp

    results = {}
    for kind in ("sft", "dpo", "grpo"):
        trainer = _trl_trainer(kind, mode, Path(workdir) / "base", Path(workdir) / mode / kind)
        trainer.train()
        reference = getattr(trainer, "ref_model", None)
        logs = trainer.state.log_history
        results[kind] = {"loss": [e["loss"] for e in logs if "loss" in e],
                         "sharded": hasattr(trainer.model, "_zeropp"),
                         "reference_bytes": _per_rank_bytes(reference) if reference is not None else None,
                         "reference_sharded": hasattr(reference, "_zeropp"),
                         "compile": (hf_zeropp.comm_stats(trainer.model)["implementations"].get("compile")
                                     if hasattr(trainer.model, "_zeropp") else None)}
        if kind == "grpo":
            results[kind]["reward"] = [e["reward"] for e in logs if "reward" in e]
    return results
