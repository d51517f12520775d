"""The checkpoint wing: saving and resuming a sharded model.

- ``checkpoint``: hf_zeropp's sharded checkpoints (torch DCP) and ``save_pretrained`` (per-rank safetensors writes);
- ``deepspeed_restore``: resuming a DeepSpeed ZeRO checkpoint into a sharded model and its optimizer;
- ``deepspeed_convert``: ``hf-zeropp from-deepspeed`` / ``to-deepspeed``, one format into the other offline.

May import: ``kernels``, ``_compat``, ``interop``, ``config``, ``comm`` and ``engine`` — never the integrations."""
