"""Peak host memory and time per rank, for the ways a model reaches shard_model and the two ways it is saved.

    python -m scripts.benchmarks.large_model_memory            # 355M and 1.5B GPT-2 shapes, 4 ranks as 2 x 2
    python -m scripts.benchmarks.large_model_memory --shapes 355m --paths eager meta pretrained
    python -m scripts.benchmarks.large_model_memory --shapes 1.5b --paths rank0 pretrained --saves per-rank consolidated

Paths (docs/large-models.md):
  eager       every rank builds the full model (GPT2LMHeadModel(config)), then shard_model — the path before
              meta-device support;
  meta        every rank builds it under torch.device("meta"); shard_model initialises only its shards;
  rank0       rank 0 loads a saved checkpoint in full, the others build it on the meta device; rank 0 sends the
              shards (what hf_zeropp.from_pretrained did before each rank read its own slices);
  pretrained  hf_zeropp.from_pretrained: every rank builds the model on the meta device and reads its own slices
              of the checkpoint's safetensors files.
The checkpoint is written once, beforehand, under --checkpoints.

Saves (after training, each into its own folder, every rank's peak reset first):
  per-rank      hf_zeropp.save_pretrained: every rank writes its slices and a share of the standard files;
  consolidated  the save before: the full state dict gathered on rank 0, written by the model's save_pretrained.

Each path runs in its own 4 processes, one after the other in this run. Per rank: peak RSS until shard_model
returns (VmHWM: building, loading and sharding; imports included), peak RSS over the whole run, RSS in training
(after the last step: the steady state), their ratio, the state bytes (parameter shards + gradients + optimizer
state, ``hf_zeropp.state_bytes``), and seconds to shard and to the end of the first optimizer step, both from the
start of building the model; for each save, its peak RSS against the RSS in training, and its seconds. SGD (no
optimizer state) and fp32 compute keep a 1.5B model on 4 CPU ranks within this machine's 24 GiB for the meta,
rank0 and pretrained paths; the eager path of the 1.5B shape needs four full copies (4 x 6.2 GB) plus the shards
and is only run with --eager-1.5b.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path


SHAPES = {"355m": {"n_embd": 1024, "n_layer": 24, "n_head": 16},   # the Table 5 shape (GPT-2 medium)
          "1.5b": {"n_embd": 1600, "n_layer": 48, "n_head": 25}}   # GPT-2 XL


def _config(shape: str):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=50257, n_positions=1024, bos_token_id=50256, eos_token_id=50256, **SHAPES[shape])


def _peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux carries that over exec from the parent, so a rank
    would report the launcher's peak (e.g. writing the checkpoint) as its own."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _one_rank(shape: str, path: str, checkpoint: str, steps: int, preset: str, node_size: int,
              saves: list[str], save_root: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GPT2LMHeadModel

    import hf_zeropp

    base = _current_rss_bytes()
    start = time.perf_counter()
    torch.manual_seed(0)
    if path == "eager":
        model = GPT2LMHeadModel(_config(shape))
    elif path == "meta":
        with torch.device("meta"):
            model = GPT2LMHeadModel(_config(shape))
    elif path == "rank0":
        on_rank_0 = torch.distributed.get_rank() == 0
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32,
                                                     **({} if on_rank_0 else {"device_map": "meta"}))
    else:
        model = hf_zeropp.from_pretrained(AutoModelForCausalLM, checkpoint, dtype=torch.float32)
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig.preset(preset, mixed_precision="no", node_size=node_size))
    sharded = time.perf_counter() - start
    peak_sharded = _peak_rss_bytes()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 50257, (1, 32), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    first_step = None
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        first_step = first_step or time.perf_counter() - start
        steady = sum(hf_zeropp.state_bytes(model, optimizer).values())  # gradients kept: the steady state
        optimizer.zero_grad(set_to_none=False)
    full = sum(p.numel() * p.element_size() for p in model.parameters())  # global sizes (DTensors)
    result = {"base": base, "peak_sharded": peak_sharded, "peak": _peak_rss_bytes(), "training": _current_rss_bytes(),
              "steady": steady, "full": full, "shard_s": sharded, "first_step_s": first_step}
    for way in saves:
        _reset_peak_rss()
        start = time.perf_counter()
        _save(model, way, f"{save_root}/{way}")
        result[f"save_{way}"] = {"peak": _peak_rss_bytes(), "s": time.perf_counter() - start}
    return result


def _save(model, way: str, directory: str) -> None:
    import torch.distributed as dist

    import hf_zeropp
    from hf_zeropp.engine.full_state import consolidated_state_dict

    if way == "per-rank":
        hf_zeropp.save_pretrained(model, directory)
        return
    state = consolidated_state_dict(model)
    if dist.get_rank() == 0:
        model.save_pretrained(directory, state_dict=state)
    del state
    dist.barrier()


def _reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS (Linux: 5 to /proc/self/clear_refs), so the next peak is the save's."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _write_checkpoint(shape: str, directory: Path) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    if (directory / "config.json").exists():
        return
    torch.manual_seed(0)
    GPT2LMHeadModel(_config(shape)).save_pretrained(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--paths", nargs="+", default=["eager", "meta", "rank0", "pretrained"],
                        choices=["eager", "meta", "rank0", "pretrained"])
    parser.add_argument("--saves", nargs="*", default=["per-rank", "consolidated"], choices=["per-rank", "consolidated"],
                        help="saves measured after training (each path); none: --saves with no value")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--preset", default="zeropp")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--checkpoints", type=Path, default=Path("out/large_models"))
    parser.add_argument("--eager-1.5b", dest="eager_big", action="store_true",
                        help="also run the eager path for 1.5b (needs ~30 GB of host memory)")
    args = parser.parse_args()

    # glibc's dynamic mmap threshold keeps freed multi-MB tensors in the heap, so RSS would show the allocator's
    # high-water mark instead of what the process holds; a fixed threshold returns them (set before the ranks start)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    from hf_zeropp.testing.spawn import run_distributed

    gb = 1e9
    print(f"{args.world} ranks as {args.world // args.node_size} x {args.node_size}, preset {args.preset}, fp32, "
          f"SGD, {args.steps} steps of 1 x 32 tokens per rank; GB = 1e9 bytes")
    print("| shape | path | rank | peak RSS until sharded | peak RSS overall | RSS in training | loading peak / "
          "training RSS | state bytes | shard s | first step s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    saves = []
    for shape in args.shapes:
        checkpoint = args.checkpoints / f"gpt2_{shape}"
        full_copy = None
        for path in args.paths:
            if path == "eager" and shape == "1.5b" and not args.eager_big:
                print(f"| {shape} | eager | all | not run: 4 full fp32 copies (4 x 6.2 GB) plus shards exceed this "
                      f"machine's 24 GiB (--eager-1.5b to try) | | | | | | |")
                continue
            if path in ("rank0", "pretrained"):
                _write_checkpoint(shape, checkpoint)
            save_root = args.checkpoints / f"saved_{shape}_{path}"
            results = run_distributed(_one_rank, args.world, shape, path, str(checkpoint), args.steps, args.preset,
                                      args.node_size, args.saves, str(save_root), node_size=args.node_size,
                                      timeout=3600.0)
            shutil.rmtree(save_root, ignore_errors=True)
            for rank, r in enumerate(results):
                full_copy = r["full"]
                print(f"| {shape} | {path} | {rank} | {r['peak_sharded'] / gb:.2f} | {r['peak'] / gb:.2f} "
                      f"| {r['training'] / gb:.2f} | {r['peak_sharded'] / r['training']:.2f} | {r['steady'] / gb:.2f} "
                      f"| {r['shard_s']:.1f} | {r['first_step_s']:.1f} |", flush=True)
                saves += [(shape, path, rank, r["training"], way, r[f"save_{way}"]) for way in args.saves]
        print(f"\n{shape}: one full fp32 copy = {full_copy / gb:.2f} GB; idle process after imports "
              f"{results[0]['base'] / gb:.2f} GB (included in every RSS figure)\n")
    if saves:
        print("| shape | path | rank | save | RSS in training | save peak RSS | save peak / training RSS | save s |")
        print("|---|---|---:|---|---:|---:|---:|---:|")
        for shape, path, rank, training, way, save in saves:
            print(f"| {shape} | {path} | {rank} | {way} | {training / gb:.2f} | {save['peak'] / gb:.2f} "
                  f"| {save['peak'] / training:.2f} | {save['s']:.1f} |")


if __name__ == "__main__":
    main()
