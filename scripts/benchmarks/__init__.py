"""The emulated-cluster benchmark behind ``scripts/bench_cluster.py`` (its command line; what it measures is in its
docstring), in parts:

* :mod:`.configs`      the configurations compared (stock FSDP2, ZeRO-3, +qwZ, +hpZ, +qgZ, ZeRO++, ZeRO++ with the
                       reference kernels) and the link rates;
* :mod:`.wire`         gloo's wire rule (node link bytes per logical meter byte) and the veth byte counters;
* :mod:`.worker`       the per-rank worker under torchrun inside the emulated cluster: gloo probe, warm-up, the
                       interleaved timed rounds, the profiled breakdown steps, raw results;
* :mod:`.breakdown`    where a step's time goes, from ``torch.profiler`` events (hf_zeropp's all-gather and
                       reduce-scatter ranges and the ``hf_zeropp::*`` kernel ops inside them);
* :mod:`.orchestrate`  the driver: one emulated cluster (network namespaces, shaped veth links, torchrun per node)
                       per link rate, running the worker;
* :mod:`.analysis`     raw results to the summary (step times, meter vs counters, breakdown, speedups, targets);
* :mod:`.report`       results.json, results.md and results.png.

Only :mod:`.worker` (and :func:`.breakdown.profile_steps`) import torch and hf_zeropp; the driver side does not.
"""
