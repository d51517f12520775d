"""Benchmarks: run from the checkout as ``python -m scripts.benchmarks.<name>``; each prints ratios measured side by
side in one run (never a timed test). Their results are the dated reports in ``docs/results/``.

Entry points (each module's docstring says what it measures and how to run it):

* :mod:`.cluster`             ZeRO++ against ZeRO-3 and stock FSDP2 on an emulated cluster with shaped links (root);
* :mod:`.lora`                RLHF generation and training with frozen INT8 weights on the emulated cluster (root);
* :mod:`.comm_table`          bytes per collective and per-rank memory per step, on local gloo processes;
* :mod:`.cost_model`          a step-time model from measured bytes, checked on ``cluster``'s results, then asked about
                              clusters this machine cannot build;
* :mod:`.kernels`             kernel bandwidth beside a plain copy and the reference kernels (CPU or CUDA);
* :mod:`.gpu_e2e`             frozen INT8 LoRA end to end on one GPU (or a CPU dry run);
* :mod:`.large_model_memory`  peak host memory and time to the first step for eager, meta and pretrained loading.

The parts of the cluster benchmark:

* :mod:`.configs`      the configurations compared (stock FSDP2, ZeRO-3, +qwZ, +hpZ, +qgZ, ZeRO++, ZeRO++ with the
                       reference kernels) and the link rates;
* :mod:`.wire`         gloo's wire rule (node link bytes per logical meter byte) and the veth byte counters;
* :mod:`.worker`       the per-rank worker under torchrun inside the emulated cluster: gloo probe, warm-up, the
                       interleaved timed rounds, the profiled breakdown steps, raw results;
* :mod:`.breakdown`    where a step's time goes, from ``torch.profiler`` events (hf_zeropp's all-gather and
                       reduce-scatter ranges and the ``hf_zeropp::*`` kernel ops inside them);
* :mod:`.orchestrate`  the driver: one emulated cluster (:mod:`hf_zeropp.testing.emulated_cluster`) per link rate,
                       running the worker;
* :mod:`.analysis`     raw results to the summary (step times, meter vs counters, breakdown, speedups, targets);
* :mod:`.report`       results.json, results.md and results.png;
* :mod:`.timing`       synchronized timing shared with the kernel and GPU benchmarks.
"""
