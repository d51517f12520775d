"""A text corpus present on every machine with Python and no network: the standard library's own source.

Used by the demo, the tests and the mini recipes so they run offline and identically everywhere.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_source_bytes(max_bytes: int) -> bytes:
    """The standard library's top-level ``.py`` files, concatenated in sorted path order, truncated."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)[:max_bytes]


def byte_sequences(max_bytes: int, seq_len: int) -> torch.Tensor:
    """Byte-level tokens (vocabulary 256) packed into ``(n, seq_len)`` sequences."""
    data = torch.frombuffer(bytearray(stdlib_source_bytes(max_bytes)), dtype=torch.uint8).long()
    return data[: len(data) // seq_len * seq_len].view(-1, seq_len)


def stdlib_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on the standard library's source (offline, deterministic), with
    ``<eos>``/``<pad>``/``<unk>`` specials — for small models trained from scratch where no hub is reachable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<eos>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([stdlib_source_bytes(300_000).decode("utf-8", "ignore")], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
