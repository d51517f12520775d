#!/usr/bin/env python3
"""One GPU, end to end: frozen INT8 LoRA ``generate()`` and training on the CUDA kernels, against stock, and the
time a step and a generation take with the custom kernels and with the plain-torch reference kernels.

    python -m scripts.benchmarks.gpu_e2e --out out/gpu_e2e                 # on a GPU machine (~1 min)
    python -m scripts.benchmarks.gpu_e2e --device cpu --hidden 64 --layers 2 --batch 2 --seq 32 --rounds 2  # dry run

One process (world size 1, NCCL on CUDA, gloo on CPU). At world size 1 there are no collectives to quantize: qwZ,
hpZ and qgZ do not apply (hf_zeropp warns and says so in ``comm_stats()["implementations"]``). What runs the kernels
here is ``quantized_nontrainable_weights``: every frozen matrix is stored as INT8 codes plus one fp32 scale per block
and dequantized at every use (forward and backward; once per ``generate()`` call). Model: GPT-2 from config
(``--hidden``, ``--layers``; vocab 50257) with LoRA r=8 on every projection, as peft builds it.

Correctness (fp32 compute, TF32 off): the sharded model on the CUDA kernels against a stock model (no hf_zeropp,
no FSDP) whose frozen matrices hold the same INT8 values (``with_stored_int8_values``): logits, greedy
``generate()`` tokens, and the losses of ``--train-steps`` AdamW steps; and against the same sharded model on the
reference kernels (the dequantized weights are bit-identical, so the losses must be too).

Timing (bf16 compute): ``--rounds`` rounds, alternating the kernel backends within each round; the median of one
training step (forward, backward, AdamW) and of one ``generate()`` of ``--new-tokens`` greedy tokens. Writes
``gpu_e2e.json`` and ``gpu_e2e.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import hf_zeropp
from hf_zeropp.testing.tiny_models import with_stored_int8_values

from .report import save
from .timing import synchronized_seconds

BLOCK = 256
LORA_TARGETS = ["c_attn", "c_proj", "c_fc"]


def base_model(hidden: int, layers: int, seq: int):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_embd=hidden, n_layer=layers, n_head=max(1, hidden // 64), n_positions=max(seq, 1024),
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    return get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0,
                                            init_lora_weights=False))


def sharded(model, device: torch.device, mixed_precision: str, kernel_backend: str | None):
    config = hf_zeropp.ZeroPPConfig(stage=3, quantized_nontrainable_weights=True, block_size=BLOCK,
                                    mixed_precision=mixed_precision, kernel_backend=kernel_backend)
    return hf_zeropp.shard_model(copy.deepcopy(model).to(device), config)


def optimizer_for(model) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)


def batch(step: int, size: int, seq: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, 50257, (size, seq), generator=torch.Generator().manual_seed(step)).to(device)


def train_step(model, optimizer, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def generate(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with hf_zeropp.gathered_for_inference(model) as inside, torch.no_grad():
        return inside.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                               do_sample=False, pad_token_id=0)


def correctness(args, device: torch.device, compiled: str) -> dict:
    model = base_model(args.hidden, args.layers, args.seq)
    stock = with_stored_int8_values(copy.deepcopy(model), world=1, block_size=BLOCK).to(device)
    runs = {"stock": stock, compiled: sharded(model, device, "no", None),
            "reference": sharded(model, device, "no", "reference")}
    implementations = hf_zeropp.comm_stats(runs[compiled])["implementations"]
    prompt = batch(0, 1, 8, device)
    ids = batch(1, args.batch, args.seq, device)
    result = {"implementations": implementations}
    with torch.no_grad():
        logits = {name: (m(input_ids=ids).logits if name == "stock" else _gathered_logits(m, ids)).float()
                  for name, m in runs.items()}
    for name in (compiled, "reference"):
        result[f"logits ({name}): largest difference to stock / largest stock logit"] = float(
            (logits[name] - logits["stock"]).abs().max() / logits["stock"].abs().max())
    tokens = {name: generate(m, prompt, args.new_tokens).tolist() for name, m in runs.items()}
    result["generate: tokens equal to stock"] = {name: tokens[name] == tokens["stock"]
                                                 for name in (compiled, "reference")}
    losses = {}
    for name, m in runs.items():
        optimizer = optimizer_for(m)
        losses[name] = [train_step(m, optimizer, batch(100 + s, args.batch, args.seq, device))
                        for s in range(args.train_steps)]
    result["losses"] = losses
    result[f"losses ({compiled}): largest difference to stock"] = max(abs(a - b) for a, b in zip(losses[compiled], losses["stock"]))
    result[f"losses ({compiled}) bit-identical to the reference kernels'"] = losses[compiled] == losses["reference"]
    return result


def _gathered_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with hf_zeropp.gathered_for_inference(model) as inside:
        return inside(input_ids=ids).logits


def timing(args, device: torch.device, compiled: str) -> dict:
    model = base_model(args.hidden, args.layers, args.seq)
    runs = {compiled: sharded(model, device, "bf16", None), "reference": sharded(model, device, "bf16", "reference")}
    optimizers = {name: optimizer_for(m) for name, m in runs.items()}
    prompt = batch(0, 1, 8, device)
    step_times = {name: [] for name in runs}
    generate_times = {name: [] for name in runs}

    for round_ in range(args.warmup + args.rounds):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            ids = batch(200 + round_, args.batch, args.seq, device)
            step = synchronized_seconds(lambda: train_step(runs[name], optimizers[name], ids), device)
            gen = synchronized_seconds(lambda: generate(runs[name], prompt, args.new_tokens), device)
            if round_ >= args.warmup:
                step_times[name].append(step)
                generate_times[name].append(gen)
    medians = {name: {"step_ms": 1e3 * statistics.median(step_times[name]),
                      "generate_ms": 1e3 * statistics.median(generate_times[name])} for name in runs}
    return {"medians": medians,
            "step: reference / compiled": medians["reference"]["step_ms"] / medians[compiled]["step_ms"],
            "generate: reference / compiled": medians["reference"]["generate_ms"] / medians[compiled]["generate_ms"],
            "frozen parameters": sum(p.numel() for p in model.parameters() if not p.requires_grad),
            "trainable parameters": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def markdown(report: dict) -> str:
    c, t, compiled = report["correctness"], report["timing"], report["compiled_backend"]
    lines = [f"Device: {report['device_name']}; torch {report['torch']}; GPT-2 hidden {report['args']['hidden']} x "
             f"{report['args']['layers']} layers, LoRA r=8 ({t['trainable parameters']:,} trainable, "
             f"{t['frozen parameters']:,} frozen); batch {report['args']['batch']} x {report['args']['seq']} tokens",
             "", "| check (fp32) | result |", "|---|---|"]
    for key, value in c.items():
        if key not in ("losses", "implementations"):
            lines.append(f"| {key} | {value} |")
    lines += ["", f"| bf16, median of {report['args']['rounds']} | {compiled} kernels | reference kernels | "
              "reference / custom |", "|---|---:|---:|---:|",
              f"| training step | {t['medians'][compiled]['step_ms']:.2f} ms | {t['medians']['reference']['step_ms']:.2f}"
              f" ms | {t['step: reference / compiled']:.2f}x |",
              f"| generate() of {report['args']['new_tokens']} tokens | {t['medians'][compiled]['generate_ms']:.1f} ms |"
              f" {t['medians']['reference']['generate_ms']:.1f} ms | {t['generate: reference / compiled']:.2f}x |"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--train-steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default="out/gpu_e2e")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1, timeout=datetime.timedelta(minutes=5),
                            **({"device_id": torch.device("cuda", 0)} if device.type == "cuda" else {}))
    try:
        compiled = hf_zeropp.kernels.active_backend(device)
        report = {"device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "compiled_backend": compiled, "args": vars(args)}
        report["correctness"] = correctness(args, device, compiled)
        print(json.dumps(report["correctness"], indent=1), flush=True)
        report["timing"] = timing(args, device, compiled)
    finally:
        dist.destroy_process_group()
    save(Path(args.out), "gpu_e2e", report, markdown(report))


if __name__ == "__main__":
    main()
