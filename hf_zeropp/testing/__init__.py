"""Shared helpers for the tests, the measurement scripts and the recipes' smoke runs — not used in training.

They live in the package, not under ``tests/``, so that every one of those imports them the same way (no edits of
the module search path) and so that ``run_distributed``'s spawned ranks and the per-rank workers find them:

- :mod:`hf_zeropp.testing.spawn` — ``run_distributed``: a function on N gloo ranks in local processes;
- :mod:`hf_zeropp.testing.corpus` — an offline text corpus and tokenizer (the standard library's own source);
- :mod:`hf_zeropp.testing.tiny_models` — small seeded GPT-2 models, batches and training loops;
- :mod:`hf_zeropp.testing.payloads` — a qgZ payload without quantization (placement and averaging alone);
- :mod:`hf_zeropp.testing.conformance` — the patterns the conformance suite runs under stock and under hf_zeropp;
- :mod:`hf_zeropp.testing.emulated_cluster` — several nodes on one machine (network namespaces, shaped links, one
  torchrun per node; ``python -m hf_zeropp.testing.emulated_cluster``), on :mod:`~hf_zeropp.testing.emulated_network`.
"""
