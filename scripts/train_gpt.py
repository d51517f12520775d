"""Train a small causal LM (GPT-2, Llama, OPT, ...) from a recipe YAML with ZeroPPTrainer (the Table 5 runner).

    torchrun --nproc_per_node 4 scripts/train_gpt.py recipes/gpt350m_pile/mini/zeropp.yaml [--max_steps 20 ...]

A recipe has three sections: ``model`` (``family``: a transformers model type, ``gpt2`` by default, and that
family's config keywords), ``data`` (corpus, tokenizer, sequence length) and ``training`` (TrainingArguments
keywords, including ``zeropp``: a preset, a file or a dict). A recipe with ``base: other.yaml`` (relative to its
folder) starts from that recipe and replaces the keys it gives in each section, so a variant states only what
differs. Any TrainingArguments
flag on the command line (``--zeropp zero3``, ``--max_steps 10``, ``--output_dir ...``) overrides the recipe.
Validation loss is evaluated on a held-out split every ``eval_steps``; every log and evaluation is appended as one
JSON line to ``<output_dir>/metrics.jsonl``, which ``scripts/experiments/report_convergence.py`` reads.

Data sources: ``stdlib`` — the Python standard library's source, or ``python_docs`` — English prose shipped with
Python (``hf_zeropp.testing.corpus``), both byte-level tokens, offline and identical on every machine; or any
``datasets``-loadable text set (``name``, optional ``config``, ``text_field``, ``streaming``) tokenized with a
transformers tokenizer (default ``gpt2``) and packed into fixed-length sequences.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils.data import Dataset, IterableDataset
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, PreTrainedModel, TrainerCallback

import hf_zeropp
from hf_zeropp.testing.corpus import CORPORA, byte_sequences


class PackedSequences(Dataset):
    def __init__(self, sequences: torch.Tensor) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = self.sequences[index]
        return {"input_ids": ids, "labels": ids}


class PackedStream(IterableDataset):
    """Tokenize a (streaming) text dataset and pack it into ``seq_len`` chunks, documents joined by EOS."""

    def __init__(self, dataset: Any, tokenizer: Any, seq_len: int, text_field: str, limit: int | None) -> None:
        self.dataset, self.tokenizer, self.seq_len = dataset, tokenizer, seq_len
        self.text_field, self.limit = text_field, limit

    def __iter__(self):
        buffer: list[int] = []
        produced = 0
        for example in self.dataset:
            buffer.extend(self.tokenizer(example[self.text_field])["input_ids"] + [self.tokenizer.eos_token_id])
            while len(buffer) >= self.seq_len:
                ids = torch.tensor(buffer[: self.seq_len])
                buffer = buffer[self.seq_len:]
                yield {"input_ids": ids, "labels": ids}
                produced += 1
                if self.limit is not None and produced >= self.limit:
                    return


def build_datasets(data: dict[str, Any]) -> tuple[Dataset | IterableDataset, Dataset | IterableDataset, int]:
    """(train, validation, vocabulary size) for the recipe's ``data`` section."""
    seq_len = int(data["seq_len"])
    source = data.get("source", "stdlib")
    if source in CORPORA:
        sequences = byte_sequences(int(data.get("max_bytes", 4_000_000)), seq_len, source)
        held_out = max(1, int(len(sequences) * float(data.get("validation_fraction", 0.05))))
        return PackedSequences(sequences[:-held_out]), PackedSequences(sequences[-held_out:]), 256
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(data.get("tokenizer", "gpt2"))
    streaming = bool(data.get("streaming", True))
    name, config = data["source"], data.get("config")
    train = load_dataset(name, config, split=data.get("train_split", "train"), streaming=streaming)
    validation = load_dataset(name, config, split=data.get("validation_split", "validation"), streaming=streaming)
    text_field = data.get("text_field", "text")
    return (PackedStream(train, tokenizer, seq_len, text_field, None),
            PackedStream(validation, tokenizer, seq_len, text_field, int(data.get("validation_sequences", 512))),
            len(tokenizer))


def build_model(model: dict[str, Any], vocab: int, seq_len: int) -> PreTrainedModel:
    """A freshly initialised causal LM of the recipe's ``family`` (any transformers model type: ``gpt2`` (default),
    ``llama``, ``opt``, ...); token 0 doubles as BOS/EOS for byte corpora and no byte is padding."""
    keywords = dict(model)
    family = keywords.pop("family", "gpt2")
    try:
        config = AutoConfig.for_model(family, vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=None,
                                      **keywords)
    except ValueError as error:
        raise SystemExit(f"model family {family!r} is not a transformers model type: {error}") from error
    config.max_position_embeddings = seq_len  # GPT-2 maps the name onto n_positions
    return AutoModelForCausalLM.from_config(config)


class MetricsFile(TrainerCallback):
    """One JSON line per log/evaluation on the main process."""

    def __init__(self, path: Path, recipe: str, seed: int) -> None:
        self.path, self.recipe, self.seed = path, recipe, seed

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as handle:
                record = {"recipe": self.recipe, "seed": self.seed, "step": state.global_step, **logs}
                handle.write(json.dumps(record) + "\n")


SECTIONS = ("model", "data", "training")


def load_recipe(path: Path, seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The recipe at ``path`` with its ``base`` chain applied (section keys of the derived recipe win)."""
    if not path.is_file():
        raise SystemExit(f"recipe {str(path)!r} does not exist")
    if path.resolve() in seen:
        raise SystemExit(f"recipe {path} is its own base (cycle through {[str(p) for p in seen]})")
    recipe = yaml.safe_load(path.read_text())
    if not isinstance(recipe, dict):
        raise SystemExit(f"recipe {path} must be a mapping of sections {SECTIONS}")
    unknown = set(recipe) - {*SECTIONS, "description", "base"}
    if unknown:
        raise SystemExit(f"recipe {path} has unknown sections {sorted(unknown)}")
    if "base" not in recipe:
        return recipe
    base = load_recipe(path.parent / recipe.pop("base"), (*seen, path.resolve()))
    for section in SECTIONS:
        base[section] = {**base.get(section, {}), **recipe.get(section, {})}
    base["description"] = recipe.get("description", base.get("description"))
    return base


def parse(argv: list[str]) -> tuple[dict[str, Any], Any]:
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: train_gpt.py RECIPE.yaml [TrainingArguments flags ...]")
    recipe_path = Path(argv[0])
    recipe = load_recipe(recipe_path)
    parser = HfArgumentParser(hf_zeropp.ZeroPPTrainingArguments)
    defaults = {k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in recipe["training"].items()}
    parser.set_defaults(**defaults)
    (training_args,) = parser.parse_args_into_dataclasses(args=argv[1:])
    recipe["name"] = recipe_path.stem
    return recipe, training_args


def main(argv: list[str] | None = None) -> None:
    recipe, args = parse(sys.argv[1:] if argv is None else argv)
    train, validation, vocab = build_datasets(recipe["data"])
    torch.manual_seed(args.seed)
    model = build_model(recipe["model"], vocab, int(recipe["data"]["seq_len"]))
    trainer = hf_zeropp.ZeroPPTrainer(model=model, args=args, train_dataset=train, eval_dataset=validation,
                                      callbacks=[MetricsFile(Path(args.output_dir) / "metrics.jsonl", recipe["name"],
                                                                 args.seed)])
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    final = trainer.evaluate()
    trainer.save_model()
    if trainer.is_world_process_zero():
        print(json.dumps({"recipe": recipe["name"], "final_eval_loss": final["eval_loss"]}))
    # as in train_grpo.py: every rank tears the process group down together instead of at interpreter exit
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
