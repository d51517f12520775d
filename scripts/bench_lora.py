"""LoRA / RLHF figures, side by side in one run: ZeRO-3 with bf16 frozen weights vs ZeRO++ with frozen INT8 + hpZ.

    python scripts/bench_lora.py [--world 4 --node-size 2] [--json out.json]

A GPT-2-style model (hidden 256, 4 layers, bf16 compute) with LoRA adapters on every projection, on local gloo
processes emulating ``world / node_size`` nodes. Per rank: bytes held for frozen weights, peak resident memory,
generation tokens/s and bytes sent per generated token (intra/inter node, after a first warm-up generation),
and the median LoRA training step time. CPU timings on a shared 2-core machine are indicative only; the byte
counts are exact.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
import torch.distributed as dist

from hf_zeropp.testing.spawn import run_distributed

CONFIGS = {
    "ZeRO-3, bf16 frozen weights": {"stage": 3, "mixed_precision": "bf16"},
    "ZeRO-3, frozen INT8 (no hpZ)": {"stage": 3, "quantized_nontrainable_weights": True, "mixed_precision": "bf16"},
    "ZeRO++, frozen INT8 + hpZ (+qwZ, qgZ)": {"preset": "zeropp-lora", "mixed_precision": "bf16"},
}
NEW_TOKENS = 16


def _model():
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=256, n_layer=4, n_head=4,
                                       bos_token_id=0, eos_token_id=0)).to(torch.bfloat16)
    # bf16 base weights (what both configurations start from); peft keeps the adapters in fp32
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["c_attn", "c_proj", "c_fc"],
                                            fan_in_fan_out=True, lora_dropout=0.0))


def _frozen_bytes(model) -> int:
    from hf_zeropp.frozen import frozen_weight_bytes

    in_fsdp = 0
    for parameter in model.parameters():
        if not parameter.requires_grad:
            local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
            in_fsdp += local.numel() * local.element_size()
    return in_fsdp + frozen_weight_bytes(model)


def _measure(configs: dict) -> dict:
    import hf_zeropp

    out = {}
    rank = dist.get_rank()
    for name, options in configs.items():
        model = _model()
        frozen_params = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig.from_dict(options))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        prompts = torch.randint(0, 1024, (4, 8), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            model.generate(input_ids=prompts, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
            hf_zeropp.comm_stats(model, reset=True)
            start = time.perf_counter()
            model.generate(input_ids=prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                           do_sample=False, pad_token_id=0)
            generation_time = time.perf_counter() - start
        generated = prompts.shape[0] * NEW_TOKENS
        generation = hf_zeropp.comm_stats(model, reset=True)["total"]
        step_times = []
        ids = torch.randint(0, 1024, (4, 64), generator=torch.Generator().manual_seed(100 + rank))
        for _ in range(6):
            dist.barrier()
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            step_times.append(time.perf_counter() - start)
        out[name] = {
            "frozen_params": frozen_params,
            "frozen_bytes": _frozen_bytes(model),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "generation_tokens_per_s": generated / generation_time,
            "intra_bytes_per_token": generation["intra_node"] / generated,
            "inter_bytes_per_token": generation["inter_node"] / generated,
            "step_time_s": statistics.median(step_times[1:]),
        }
    return out


def table(result: dict) -> str:
    lines = ["| configuration | frozen-weight bytes / rank | peak RSS / rank | generation tokens/s / rank | "
             "bytes per generated token (intra / inter node) | LoRA step time |",
             "|---|---:|---:|---:|---|---:|"]
    for name, r in result.items():
        lines.append(f"| {name} | {r['frozen_bytes'] / 1e6:.3f} MB | {r['peak_rss_mb']:.0f} MB | "
                     f"{r['generation_tokens_per_s']:.1f} | {r['intra_bytes_per_token'] / 1e3:.1f} kB / "
                     f"{r['inter_bytes_per_token'] / 1e3:.1f} kB | {r['step_time_s'] * 1e3:.0f} ms |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    result = run_distributed(_measure, args.world, CONFIGS, node_size=args.node_size)[0]
    frozen = next(iter(result.values()))["frozen_params"]
    print(f"GPT-2-style model with LoRA, {frozen / 1e6:.2f}M frozen parameters (bf16: {2 * frozen / 1e6:.2f} MB), "
          f"{args.world} ranks = {args.world // args.node_size} nodes x {args.node_size}, rank 0:\n")
    print(table(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)


if __name__ == "__main__":
    main()
