#!/usr/bin/env python3
"""RLHF on slow links, side by side: ZeRO-3 with bf16 frozen weights vs ZeRO++ with frozen INT8 + hpZ, each with
generation gathering the weights per token (FSDP's per-forward gathering) and once per generate() call.

    sudo .venv/bin/python -m scripts.benchmarks.lora --out out/bench_lora --rounds 8   # ~4 min (bf16; fp32 ~6 min)
    sudo .venv/bin/python -m scripts.benchmarks.lora --out out/bench_lora --quick      # ~2 min

For each link rate (100mbit, 1gbit, unshaped) one emulated cluster of 2 nodes x 2 gloo ranks is built with
hf_zeropp/testing/emulated_cluster.py (network namespaces, veth links shaped with tc) and, in that one launch, every
configuration runs side by side:

* ``ZeRO-3 per-token``   ``{"stage": 3, "generation_gather": "per_token"}``: bf16 frozen weights in FSDP, gathered
                         across the world for every forward (what generate() did before ``generation_gather``)
* ``ZeRO-3 per-call``    ``{"stage": 3}``: the same, gathered once per generate() call
* ``ZeRO++ per-token``   ``preset="zeropp-lora"`` (qwZ, hpZ, qgZ, frozen INT8), ``generation_gather="per_token"``
* ``ZeRO++ per-call``    ``preset="zeropp-lora"`` (the default ``generation_gather="per_call"``)

with bf16 base weights and ``mixed_precision="bf16"`` (``--precision fp32``: fp32 weights and compute). Model:
GPT-2 from config (hidden 256, 4 layers, 4 heads, vocab 1024: 3.44 M frozen parameters) with LoRA r=8 on every projection as the policy, and the same base sharded with
``shard_model(frozen=True)`` as the reference model. One step is shaped as TRL's GRPO step: each rank generates
``--generations`` sampled completions of ``--new-tokens`` tokens for each of ``--prompts`` prompts, computes
reference log-probs (no grad), the policy's log-probs, a GRPO loss (group-normalised reward advantages, KL to the
reference with beta 0.04), backward and an AdamW step. It is a hand-written loop, not TRL's trainer, so that the
configurations can be interleaved; tests/conformance/test_conformance.py checks TRL's GRPOTrainer behind the mixin
against stock.

Timing: ``--warmup`` steps per configuration, then ``--rounds`` rounds of one step each, the order rotating every
round. Times are the slowest rank's; the table shows medians. Generation tokens/s per rank = completion tokens one
rank generates / generation time. Memory per rank: policy + reference bytes at rest (``state_bytes``:
shards, INT8 stores, LoRA optimizer state) and the peak of ``gathered_parameter_bytes`` during generation (what the
per-call path holds: the whole model in bf16), read at every token of the warm-up steps only. Bytes sent per step (hf_zeropp's meter, intra / inter node).

Writes ``results.json`` and ``results.md`` under ``--out``. Needs root, ``ip`` and ``tc``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


from .orchestrate import output_folder, parse_cli, run_emulated

LINKS = ("100mbit", "1gbit", "none")
CONFIGS = {
    "ZeRO-3 per-token": {"stage": 3, "generation_gather": "per_token"},
    "ZeRO-3 per-call": {"stage": 3},
    "ZeRO++ per-token": {"preset": "zeropp-lora", "generation_gather": "per_token"},
    "ZeRO++ per-call": {"preset": "zeropp-lora"},
}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# (numerator, denominator, the issue's target ratio or None, links it applies to)
RATIOS = {
    "generation": [("ZeRO++ per-call", "ZeRO-3 per-call", {"100mbit": 2.0, "none": 0.9}),
                   ("ZeRO++ per-call", "ZeRO-3 per-token", {}),
                   ("ZeRO++ per-token", "ZeRO-3 per-token", {})],
    "grpo_step": [("ZeRO++ per-call", "ZeRO-3 per-call", {"100mbit": 1.25}),
                  ("ZeRO++ per-call", "ZeRO-3 per-token", {})],
}
VOCAB = 1024


# ---------------------------------------------------------------- worker (every rank, under torchrun)

def _models(options: dict, precision: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_zeropp

    def base():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=256, n_layer=4, n_head=4,
                                          bos_token_id=0, eos_token_id=0)).to(getattr(torch, DTYPES[precision]))

    policy = get_peft_model(base(), LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"],
                                               fan_in_fan_out=True, lora_dropout=0.0))
    options = {**options, "mixed_precision": "bf16" if precision == "bf16" else "no"}
    hf_zeropp.shard_model(policy, options)
    reference = hf_zeropp.shard_model(base(), options, frozen=True)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-4)
    return policy, reference, optimizer


def _token_logprobs(model, ids, prompt_length: int):
    import torch

    logits = model(input_ids=ids).logits[:, prompt_length - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_length:, None]).squeeze(-1)


def _grpo_step(policy, reference, optimizer, prompts, args, record_peak: bool) -> dict:
    """One GRPO-shaped step; returns the generation and whole-step times and, with ``record_peak`` (warm-up steps
    only: reading the held bytes at every token costs time the timed steps should not include), the peak held
    bytes."""
    import torch
    from transformers import LogitsProcessor

    import hf_zeropp

    peak = [0]

    class RecordHeld(LogitsProcessor):
        def __call__(self, input_ids, scores):
            peak[0] = max(peak[0], hf_zeropp.gathered_parameter_bytes(policy))
            return scores

    start = time.perf_counter()
    batch = prompts.repeat_interleave(args.generations, 0)
    with torch.no_grad():
        ids = policy.generate(input_ids=batch, attention_mask=torch.ones_like(batch), max_new_tokens=args.new_tokens,
                              min_new_tokens=args.new_tokens, do_sample=True, top_k=0, pad_token_id=0,
                              logits_processor=[RecordHeld()] if record_peak else None)
    generated = time.perf_counter()
    completions = ids[:, prompts.shape[1]:]
    rewards = (completions % 2 == 0).float().mean(-1).view(-1, args.generations)  # a rule-based reward
    advantages = ((rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, keepdim=True) + 1e-4)).view(-1, 1)
    with torch.no_grad():
        reference_logprobs = _token_logprobs(reference, ids, prompts.shape[1])
    logprobs = _token_logprobs(policy, ids, prompts.shape[1])
    delta = reference_logprobs - logprobs
    kl = torch.exp(delta) - delta - 1
    loss = (-torch.exp(logprobs - logprobs.detach()) * advantages + 0.04 * kl).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    end = time.perf_counter()
    return {"generation_s": generated - start, "step_s": end - start, "peak_held": peak[0]}


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import hf_zeropp

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    names = [name for name in args.configs.split(",") if name]
    setups = {name: _models(CONFIGS[name], args.precision) for name in names}
    prompts = torch.randint(1, VOCAB, (args.prompts, args.prompt_length),
                            generator=torch.Generator().manual_seed(rank))
    torch.manual_seed(100 + rank)  # sampling in generate()
    records: dict[str, list] = {name: [] for name in names}

    def step(name: str, record_peak: bool = False) -> dict:
        policy, reference, optimizer = setups[name]
        dist.barrier()
        timed = _grpo_step(policy, reference, optimizer, prompts, args, record_peak)
        stats = {"policy": hf_zeropp.comm_stats(policy, reset=True),
                 "reference": hf_zeropp.comm_stats(reference, reset=True)}
        slowest = torch.tensor([timed["generation_s"], timed["step_s"]])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return {"generation_s": float(slowest[0]), "step_s": float(slowest[1]), "peak_held": timed["peak_held"],
                "intra_bytes": sum(s["total"]["intra_node"] for s in stats.values()),
                "inter_bytes": sum(s["total"]["inter_node"] for s in stats.values()),
                "implementations": stats["policy"]["implementations"].get("inference")}

    peaks = {name: max(step(name, record_peak=True)["peak_held"] for _ in range(args.warmup)) for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            records[name].append(step(name))
    result = {}
    for name in names:
        policy, reference, optimizer = setups[name]
        at_rest = {"policy": hf_zeropp.state_bytes(policy, optimizer), "reference": hf_zeropp.state_bytes(reference)}
        result[name] = {"steps": records[name], "at_rest": at_rest, "peak_held": peaks[name]}
    if rank == 0:
        Path(args.result).write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver

def summarise(raw: dict[str, dict], args) -> dict:
    """Per link and configuration: median generation tokens/s per rank and GRPO step time, bytes, memory; the
    ratios and whether each target is met."""
    tokens_per_rank = args.prompts * args.generations * args.new_tokens
    summary: dict = {"links": {}, "ratios": {}}
    for link, by_config in raw.items():
        rows = {}
        for name, record in by_config.items():
            if name in ("emulator", "loadavg_before_after"):
                continue
            steps = record["steps"]
            generation = statistics.median(s["generation_s"] for s in steps)
            rest = record["at_rest"]
            rows[name] = {
                "generation_tokens_per_s": tokens_per_rank / generation,
                "generation_s": generation,
                "grpo_step_s": statistics.median(s["step_s"] for s in steps),
                "inter_node_mb_per_step": statistics.median(s["inter_bytes"] for s in steps) / 1e6,
                "intra_node_mb_per_step": statistics.median(s["intra_bytes"] for s in steps) / 1e6,
                "policy_mb": sum(rest["policy"].values()) / 1e6,
                "reference_mb": sum(rest["reference"].values()) / 1e6,
                "peak_gathered_mb": record["peak_held"] / 1e6,
                "inference": steps[-1]["implementations"],
            }
        summary["links"][link] = rows
        ratios = []
        for metric, pairs in RATIOS.items():
            for numerator, denominator, targets in pairs:
                if numerator not in rows or denominator not in rows:
                    continue
                if metric == "generation":
                    ratio = rows[numerator]["generation_tokens_per_s"] / rows[denominator]["generation_tokens_per_s"]
                else:
                    ratio = rows[denominator]["grpo_step_s"] / rows[numerator]["grpo_step_s"]
                target = targets.get(link)
                ratios.append({"metric": metric, "of": numerator, "over": denominator, "ratio": ratio,
                               "target": target, "met": None if target is None else ratio >= target})
        summary["ratios"][link] = ratios
    return summary


def markdown(summary: dict, args) -> str:
    lines = [f"{args.precision} weights and compute; {args.prompts} prompts x {args.generations} completions x {args.new_tokens} new tokens per rank, "
             f"2 nodes x 2 ranks; medians of {args.rounds} rounds; slowest rank's times.", "",
             "| link | configuration | generation tokens/s / rank | GRPO step | inter-node MB / step | "
             "policy + reference MB / rank at rest | peak gathered MB in generation |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for link, rows in summary["links"].items():
        for name, r in rows.items():
            lines.append(f"| {link} | {name} | {r['generation_tokens_per_s']:.0f} | {r['grpo_step_s']:.2f} s | "
                         f"{r['inter_node_mb_per_step']:.2f} | {r['policy_mb']:.2f} + {r['reference_mb']:.2f} | "
                         f"{r['peak_gathered_mb']:.2f} |")
    lines += ["", "| link | metric | ratio | target |", "|---|---|---:|---|"]
    for link, ratios in summary["ratios"].items():
        for r in ratios:
            what = "tokens/s" if r["metric"] == "generation" else "GRPO step speed"
            target = "" if r["target"] is None else f"≥ {r['target']}: {'met' if r['met'] else 'MISSED'}"
            lines.append(f"| {link} | {what}, {r['of']} / {r['over']} | {r['ratio']:.2f}x | {target} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/bench_lora")
    parser.add_argument("--quick", action="store_true", help="1 warm-up step and 2 rounds")
    parser.add_argument("--links", default=",".join(LINKS))
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per configuration (at least 1: they "
                        "also measure the peak gathered bytes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", choices=tuple(DTYPES), default="bf16",
                        help="base weights and compute dtype (fp32: ZeRO-3 then gathers 4 bytes per weight)")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per rank")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-length", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parse_cli(parser, CONFIGS)
    if args.warmup < 1:
        parser.error(f"--warmup {args.warmup}: at least 1 (the warm-up step measures the peak gathered bytes)")
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.warmup, args.rounds = 1, 2
    out = output_folder(args, "bench_lora")
    if out is None:
        return 2
    worker_args = ["--worker", "--configs", args.configs, "--warmup", str(args.warmup), "--rounds", str(args.rounds),
                   "--precision", args.precision, "--prompts", str(args.prompts), "--generations",
                   str(args.generations), "--prompt-length", str(args.prompt_length), "--new-tokens",
                   str(args.new_tokens)]
    started = time.monotonic()
    raw = {}
    for link in (link for link in args.links.split(",") if link):
        result = out / f"raw_{link}.json"
        raw[link] = run_emulated("scripts.benchmarks.lora", [*worker_args, "--result", str(result)], link, result,
                                 out / f"counters_{link}.json", nodes=2, nproc_per_node=2, threads=args.threads,
                                 timeout=args.timeout, python=args.python)
    summary = summarise(raw, args)
    summary["settings"] = {k: v for k, v in vars(args).items() if k not in ("worker", "result")}
    summary["wall_s"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    table = markdown(summary, args)
    (out / "results.md").write_text(table + "\n")
    print(table)
    print(f"bench_lora: wrote {out}/results.json and results.md in {summary['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
