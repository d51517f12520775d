"""The engine wing: a model sharded and trained with ZeRO 1-3 and ZeRO++.

- ``sharding``: :func:`shard_model`, which puts everything below together; ``state``: what a sharded model carries;
- ``materialize`` / ``skeleton``: ``from_pretrained`` with per-rank slices from the empty (meta) model;
- ``full_state`` / ``frozen`` / ``inference``: whole tensors gathered, INT8 frozen weights, gathering for generation;
- ``optimizer_hooks``, ``runtime`` (the public run-time calls), ``auto`` / ``auto_trial`` (the ``auto`` preset),
  ``reports`` (what a model was given and why), ``failure_report`` (torchrun's root cause, installed on import).

May import: ``kernels``, ``_compat``, ``interop``, ``config`` and ``comm`` — never checkpoints or integrations."""
