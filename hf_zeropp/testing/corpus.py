"""Text corpora present on every machine with Python and no network.

``stdlib``: the standard library's own source (code). ``python_docs``: English prose shipped with Python (the
documentation topics behind ``help()`` and the standard library subpackages' docstrings), a second corpus of another
kind for checking that an accuracy result is not specific to one dataset. Used by the demo, the tests and the mini
recipes so they run offline and identically everywhere.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path
from typing import Callable

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


# Subpackages that distributions often ship separately or strip (tests, GUI, demos) or that hold third-party code:
# leaving them out keeps the corpus the same wherever this Python version is installed.
_OPTIONAL_SUBPACKAGES = frozenset({"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip",
                                   "site-packages", "dist-packages"})


def python_docs_bytes(max_bytes: int) -> bytes:
    """The documentation topics (sorted by name), then every docstring of the standard library's subpackages (sorted
    path order, modules, classes and functions in ``ast.walk`` order), separated by blank lines, truncated. The
    top-level modules are left out: they are the ``stdlib`` corpus."""
    from pydoc_data.topics import topics

    chunks = [topics[name].encode() for name in sorted(topics)]
    total = sum(map(len, chunks))
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.glob("*/**/*.py")):
        if total >= max_bytes:
            break
        if _OPTIONAL_SUBPACKAGES.intersection(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except SyntaxError:  # data files shaped like Python (e.g. grammar fixtures)
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                docstring = ast.get_docstring(node)
                if docstring:
                    chunks.append(docstring.encode())
                    total += len(chunks[-1]) + 2
    return b"\n\n".join(chunks)[:max_bytes]


CORPORA: dict[str, Callable[[int], bytes]] = {"stdlib": stdlib_source_bytes, "python_docs": python_docs_bytes}


def byte_sequences(max_bytes: int, seq_len: int, corpus: str = "stdlib") -> torch.Tensor:
    """Byte-level tokens (vocabulary 256) of one of ``CORPORA`` packed into ``(n, seq_len)`` sequences."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; the offline corpora are {sorted(CORPORA)}")
    data = torch.frombuffer(bytearray(CORPORA[corpus](max_bytes)), dtype=torch.uint8).long()
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
