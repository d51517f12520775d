"""The comm wing: who talks to whom, and the collectives of ZeRO++.

- ``topology`` / ``node_size``: world, nodes and the hpZ and hierarchical groups;
- ``comm_meter``: the byte counts behind ``comm_stats``; ``layout``: where a unit's parameters lie in FSDP2's buffers;
- ``qwz`` (quantized weight all-gather), ``hpz`` (node-local secondary shards), ``qgz`` / ``qgz_payload`` (quantized
  gradient reduce-scatter), ``hybrid`` (hybrid sharding's replica all-reduce), ``replicated`` (parameters FSDP2
  cannot shard, trained as DDP trains them).

May import: ``kernels``, ``_compat``, ``interop`` and ``config`` — never the engine that calls these collectives."""
