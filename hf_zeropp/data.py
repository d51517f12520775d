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
