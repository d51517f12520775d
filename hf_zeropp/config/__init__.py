"""The config wing: what a user asks for, checked before anything runs.

- ``config``: :class:`ZeroPPConfig` (presets, files, ``ZEROPP_*`` variables, a DeepSpeed config's ZeRO(++) keys);
- ``config_rules``: the rules between options; ``presets``: the named configurations; ``field_types``: the fields'
  types and coercion;
- ``fsdp_settings`` / ``fsdp_keys``: Accelerate's and the Trainer's FSDP settings as hf_zeropp options, key by key.

May import: ``kernels``, ``_compat`` and ``interop`` (the DeepSpeed config mapping) — nothing that communicates."""
