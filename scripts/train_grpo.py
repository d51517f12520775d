"""LoRA RLHF with TRL's GRPOTrainer behind ZeroPPTrainerMixin: generation → reward → policy update.

    ZEROPP_NODE_SIZE=2 torchrun --standalone --nproc_per_node 4 scripts/train_grpo.py \\
        recipes/lora_rlhf/mini.yaml [--max_steps 10 ...]

A recipe has ``model`` (``name_or_path`` of a pretrained causal LM, or ``from_config`` GPT-2 keywords with the
offline ``stdlib`` tokenizer), ``lora`` (peft LoraConfig keywords), ``task`` (the prompts and the python reward
function: ``digits`` — the fraction of the completion's characters that are digits, verifiable and learnable from
scratch in minutes — or ``gsm8k`` — exact match of the final number, for a pretrained instruct model) and
``training`` (GRPOConfig keywords, ``zeropp`` included). GRPOConfig flags on the command line override the recipe.
Every log line goes to ``<output_dir>/metrics.jsonl``; ``<output_dir>/reward.png`` plots the mean reward.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import HfArgumentParser, TrainerCallback

import hf_zeropp


def digits_reward(completions: list[str], **_: Any) -> list[float]:
    """Fraction of the completion's non-space characters that are digits."""
    rewards = []
    for text in completions:
        chars = [c for c in text if not c.isspace()]
        rewards.append(sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return rewards


def gsm8k_reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
    """1 if the completion's last number equals the reference answer (after GSM8K's ``####``), else 0."""
    rewards = []
    for text, reference in zip(completions, answer):
        numbers = re.findall(r"-?\d[\d,]*\.?\d*", text)
        expected = reference.split("####")[-1].strip().replace(",", "")
        rewards.append(float(bool(numbers) and numbers[-1].replace(",", "").rstrip(".") == expected))
    return rewards


def build_task(task: dict[str, Any]):
    from datasets import Dataset, load_dataset

    if task["reward"] == "digits":
        generator = torch.Generator().manual_seed(0)
        starts = ["Value:", "x =", "Total", "id", "The number", "count:", "n =", "return"]
        prompts = [starts[int(i)] for i in torch.randint(0, len(starts), (int(task.get("prompts", 512)),),
                                                           generator=generator)]
        return Dataset.from_dict({"prompt": prompts}), digits_reward
    if task["reward"] == "gsm8k":
        dataset = load_dataset("openai/gsm8k", "main", split="train")
        template = task.get("template", "{question}\nAnswer with the final number after '####'.")
        dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": template.format(**row)}]})
        return dataset, gsm8k_reward
    raise SystemExit(f"unknown task reward {task['reward']!r}; use digits or gsm8k")


def build_model(spec: dict[str, Any]):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    if "name_or_path" in spec:
        tokenizer = AutoTokenizer.from_pretrained(spec["name_or_path"])
        dtype = getattr(torch, spec.get("dtype", "bfloat16"))
        return AutoModelForCausalLM.from_pretrained(spec["name_or_path"], dtype=dtype), tokenizer
    from hf_zeropp.testing.corpus import stdlib_tokenizer

    tokenizer = stdlib_tokenizer(int(spec.get("vocab_size", 512)))
    torch.manual_seed(int(spec.get("seed", 0)))
    config = GPT2Config(vocab_size=len(tokenizer), bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        **spec["from_config"])
    return GPT2LMHeadModel(config), tokenizer


class MetricsFile(TrainerCallback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                handle.write(json.dumps({"step": state.global_step, **logs}) + "\n")


def plot_reward(metrics: Path, out: Path) -> list[tuple[int, float]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["step"], r["reward"]) for r in map(json.loads, metrics.read_text().splitlines()) if "reward" in r]
    if points:
        figure, axes = plt.subplots(figsize=(6, 4))
        axes.plot(*zip(*points), marker="o", markersize=3)
        axes.set_xlabel("step")
        axes.set_ylabel("mean reward")
        axes.set_title("GRPO with LoRA, frozen INT8 base (hf_zeropp)")
        axes.grid(alpha=0.3)
        figure.tight_layout()
        figure.savefig(out, dpi=120)
        plt.close(figure)
    return points


def main(argv: list[str] | None = None) -> None:
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    argv = sys.argv[1:] if argv is None else argv
    if not argv or not Path(argv[0]).is_file():
        raise SystemExit("usage: train_grpo.py RECIPE.yaml [GRPOConfig flags ...]")
    recipe = yaml.safe_load(Path(argv[0]).read_text())
    parser = HfArgumentParser(hf_zeropp.with_zeropp_field(GRPOConfig))
    parser.set_defaults(**{k: json.dumps(v) if isinstance(v, dict) else v for k, v in recipe["training"].items()})
    (args,) = parser.parse_args_into_dataclasses(args=argv[1:])

    class ZeroPPGRPOTrainer(hf_zeropp.ZeroPPTrainerMixin, GRPOTrainer):
        pass

    model, tokenizer = build_model(recipe["model"])
    dataset, reward = build_task(recipe["task"])
    metrics = Path(args.output_dir) / "metrics.jsonl"
    trainer = ZeroPPGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                                processing_class=tokenizer, peft_config=LoraConfig(**recipe["lora"]),
                                callbacks=[MetricsFile(metrics)])
    trainer.train()
    trainer.save_model()  # the LoRA adapter, in peft format
    if trainer.is_world_process_zero():
        points = plot_reward(metrics, Path(args.output_dir) / "reward.png")
        first, last = points[: max(1, len(points) // 5)], points[-max(1, len(points) // 5):]
        print(json.dumps({"reward_first": sum(r for _, r in first) / len(first),
                          "reward_last": sum(r for _, r in last) / len(last)}))
    # Tear the process group down on every rank together: left to interpreter exit, a rank's gloo threads can be
    # destroyed while still joinable, which aborts that rank (SIGABRT) after a successful run.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
