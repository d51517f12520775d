"""Kernel throughput: every op's effective bandwidth beside a plain copy of the same bytes and beside the reference.

    python -m scripts.benchmarks.kernels [--device cpu|cuda] [--sizes 1M,4M,16M,64M] [--dtype bf16] [--out bench/]
        [--label NAME] [--compiled-only] [--torchao] [--check]

Effective bandwidth = (bytes read + bytes written) / median time. "copy" is ``dst.copy_(src)`` of a buffer the
size of the op's input on the same device — the physical limit a memory-bound kernel can approach. Dequantize
writes into a preallocated ``out`` (as qwZ writes into FSDP's all-gather buffer). Ratios are
measured side by side in one run; the script prints the issue's targets and whether each was met:
CPU ``cpp`` >= 5x the reference for INT8/INT4 quantize and dequantize at 16M elements; GPU at >= 16M
elements, of copy bandwidth: quantization >= 85 %, dequantization and the reductions >= 70 %, the Hadamard paths
>= 50 %, and >= 5x the reference; ``swizzle_quantize`` within 10 % of plain ``quantize``.
It also prints the cost of qgZ's Hadamard rotation (docs/accuracy.md, "Beyond ZeRO++"): the two ops that rotate, with ``hadamard=64``,
timed against the same ops without it.

``--compiled-only`` skips the reference (timing another version of the kernels, built from
``HF_ZEROPP_KERNEL_SOURCES``; ``--label`` names its files). ``--torchao`` adds the side-by-side anchor: torchao's
Triton blockwise quantization (bf16 -> fp8 in blocks of 1 x 128, one fp32 scale per block) beside our INT8
quantization with blocks of 128, at each size, on the same device. ``--check`` compares every op's output with the
reference's on the same input, bit for bit, at every size timed.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import hf_zeropp.kernels as K

from .report import save
from .timing import synchronized_seconds

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BLOCK = 256
HADAMARD = 64


def _parse_size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * scale)


def _time(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up (and first-use build)
    return statistics.median(synchronized_seconds(fn, device) for _ in range(reps))


def _ops(n: int, dtype: torch.dtype, device: torch.device):
    """(name, callable(backend), bytes moved) for every op at ``n`` input elements."""
    x = torch.randn(n, device=device).to(dtype).view(-1, 1 << 16) if n % (1 << 16) == 0 else \
        torch.randn(1, n, device=device).to(dtype)
    elem = x.element_size()
    nb = K.num_blocks(x.shape[-1], BLOCK) * x.shape[0]
    q8 = K.quantize(x, 8, BLOCK, backend="reference")
    q4 = K.quantize(x, 4, BLOCK, backend="reference")
    # dequantization writes into a preallocated buffer, as qwZ does into the all-gather output: a fresh 64 MB
    # tensor per call would time the OS faulting its pages in, not the kernel
    out = torch.empty_like(x)
    k = 4  # qgZ's reductions: k = ranks per node (hop 1) or nodes (hop 2); n elements in all
    per_input = n // k
    stacked4 = K.quantize(torch.randn(k, 1, per_input, device=device), 4, BLOCK, backend="reference")
    stacked_bytes = k * (per_input // 2 + 4 * K.num_blocks(per_input, BLOCK))
    ops = [
        ("quantize int8", lambda b: K.quantize(x, 8, BLOCK, backend=b), n * elem + n + 4 * nb),
        ("quantize int4", lambda b: K.quantize(x, 4, BLOCK, backend=b), n * elem + n // 2 + 4 * nb),
        ("quantize int4 stochastic", lambda b: K.quantize(x, 4, BLOCK, stochastic=True, seed=7, backend=b),
         n * elem + n // 2 + 4 * nb),
        ("dequantize int8", lambda b: K.dequantize(*q8, bits=8, block_size=BLOCK, dtype=dtype, out=out, backend=b),
         n + 4 * nb + n * elem),
        ("dequantize int4", lambda b: K.dequantize(*q4, bits=4, block_size=BLOCK, dtype=dtype, out=out, backend=b),
         n // 2 + 4 * nb + n * elem),
        ("swizzle_quantize int4 (2x4, 2 stages)",
         lambda b: K.swizzle_quantize(x.reshape(-1), 2, 4, 2, 4, BLOCK, backend=b), n * elem + n // 2 + 4 * nb),
        (f"dequant_reduce_quant int4 (k={k})",
         lambda b: K.dequant_reduce_quant(*stacked4, in_bits=4, out_bits=4, block_size=BLOCK, length=per_input,
                                          backend=b),
         stacked_bytes + stacked_bytes // k),
        (f"dequant_reduce int4 (k={k})",
         lambda b: K.dequant_reduce(*stacked4, bits=4, block_size=BLOCK, length=per_input, scale=0.25, backend=b),
         stacked_bytes + 4 * per_input),
        (f"swizzle_quantize int4 (2x4, 2 stages) + Hadamard {HADAMARD}",
         lambda b: K.swizzle_quantize(x.reshape(-1), 2, 4, 2, 4, BLOCK, hadamard=HADAMARD, backend=b),
         n * elem + n // 2 + 4 * nb),
        (f"dequant_reduce int4 (k={k}) + Hadamard {HADAMARD}",
         lambda b: K.dequant_reduce(*stacked4, bits=4, block_size=BLOCK, length=per_input, scale=0.25,
                                    hadamard=HADAMARD, backend=b),
         stacked_bytes + 4 * per_input),
    ]
    return x, ops


def _torchao_anchor(n: int, dtype: torch.dtype, device: torch.device):
    """(name, callable(backend), bytes moved) for torchao's 1 x 128 fp8 blockwise quantization and ours with blocks
    of 128 on the same (rows, 65536) input; torchao raises ImportError where it is not installed."""
    from torchao.prototype.blockwise_fp8_training.kernels import triton_fp8_blockwise_act_quant_lhs

    x = torch.randn(n, device=device).to(dtype).view(-1, 1 << 16)
    scales = 4 * n // 128
    return [("torchao fp8 blockwise quantize (1x128)", lambda b: triton_fp8_blockwise_act_quant_lhs(x, 128),
             n * x.element_size() + n + scales),
            ("quantize int8 (block 128)", lambda b: K.quantize(x, 8, 128, backend=b), n * x.element_size() + n + scales)]


def _same_outputs(compiled, reference) -> bool:
    """Bitwise equality of two ops' outputs (a tensor or a tuple of them); any NaN matches any NaN."""
    pairs = zip(*(r if isinstance(r, tuple) else (r,) for r in (compiled, reference)), strict=True)
    return all(torch.equal(a.nan_to_num(1234.5), b.nan_to_num(1234.5)) if a.is_floating_point() else torch.equal(a, b)
               for a, b in pairs)


def _matches_reference(fn, compiled: str) -> bool:
    """The compiled kernel's output against the reference's on the same input: at these sizes each GPU thread does
    several tiles, which the unit tests' small inputs never make it do."""
    def outputs(backend: str):
        result = fn(backend)  # dequantization writes into a shared buffer: keep a copy
        return tuple(t.clone() for t in result) if isinstance(result, tuple) else result.clone()

    return _same_outputs(outputs(compiled), outputs("reference"))


def run(device: torch.device, sizes: list[int], dtype_name: str, reps: int, compiled_only: bool = False,
        torchao: bool = False, check: bool = False) -> list[dict]:
    dtype = DTYPES[dtype_name]
    compiled = K.active_backend(device)
    backends = [compiled] if compiled_only else list(dict.fromkeys([compiled, "reference"]))
    rows = []
    for n in sizes:
        x, ops = _ops(n, dtype, device)
        if torchao:
            ops = _torchao_anchor(n, dtype, device) + ops
        src = torch.empty(n * x.element_size(), dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        copy_time = _time(lambda: dst.copy_(src), device, reps)
        copy_bw = 2 * src.numel() / copy_time
        for name, fn, moved in ops:
            row = {"device": device.type, "dtype": dtype_name, "elements": n, "op": name, "bytes": moved,
                   "copy_GBps": copy_bw / 1e9}
            for backend in backends if not name.startswith("torchao") else [compiled]:
                seconds = _time(lambda: fn(backend), device, reps)
                row[f"{backend}_ms"] = seconds * 1e3
                row[f"{backend}_GBps"] = moved / seconds / 1e9
            row["compiled_backend"] = compiled
            if check and not name.startswith("torchao"):
                row["matches_reference"] = _matches_reference(fn, compiled)
            row["fraction_of_copy"] = row[f"{compiled}_GBps"] / row["copy_GBps"]
            if "reference_ms" in row:
                row["speedup_vs_reference"] = row["reference_ms"] / row[f"{compiled}_ms"]
            rows.append(row)
            versus = (f"reference: {row['reference_ms']:9.3f} ms  x{row['speedup_vs_reference']:.1f}"
                      if "reference_ms" in row else "")
            print(f"{n:>11,d} {name:<38} {compiled}: {row[f'{compiled}_ms']:9.3f} ms "
                  f"{row[f'{compiled}_GBps']:7.2f} GB/s ({row['fraction_of_copy']:.0%} of copy)  {versus}"
                  f"{_check_mark(row)}", flush=True)
    return rows


def _check_mark(row: dict) -> str:
    if "matches_reference" not in row:
        return ""
    return "  = reference" if row["matches_reference"] else "  DIFFERS FROM THE REFERENCE"


def markdown(rows: list[dict]) -> str:
    compiled = rows[0]["compiled_backend"]
    lines = [f"| elements | op | {compiled} ms | {compiled} GB/s | copy GB/s | % of copy | reference ms | speed-up |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        reference = (f"{r['reference_ms']:.3f} | {r['speedup_vs_reference']:.1f}x" if "reference_ms" in r
                     else "- | -")
        lines.append(f"| {r['elements']:,} | {r['op']} | {r[f'{compiled}_ms']:.3f} | {r[f'{compiled}_GBps']:.2f} | "
                     f"{r['copy_GBps']:.2f} | {r['fraction_of_copy']:.0%} | {reference} |")
    return "\n".join(lines)


def _bandwidth_target(op: str) -> float | None:
    """The share of copy bandwidth a GPU op is meant to reach: 85 % for quantization, 70 % for dequantization and
    the reductions, 50 % for the Hadamard paths (their shuffles); None for the anchors, which are not ours."""
    if op.startswith("torchao") or "block 128" in op:
        return None
    if "Hadamard" in op:
        return 0.50
    if op.startswith(("quantize", "swizzle_quantize")):
        return 0.85
    return 0.70


def targets(rows: list[dict]) -> list[str]:
    verdicts = []
    big = [r for r in rows if r["elements"] >= 16 * (1 << 20)]
    at16 = [r for r in rows if r["elements"] == 16 * (1 << 20)] or big[:0]
    for r in at16:
        if r["op"].startswith(("quantize", "dequantize")) and "reference_ms" in r:
            ok = r["speedup_vs_reference"] >= 5
            verdicts.append(f"{'met ' if ok else 'MISSED'} {r['op']} @16M: {r['speedup_vs_reference']:.1f}x reference "
                            f"(target >= 5x)")
    if rows and rows[0]["device"] == "cuda":
        for r in big:
            target = _bandwidth_target(r["op"])
            if target is None:
                continue
            ok = r["fraction_of_copy"] >= target
            verdicts.append(f"{'met ' if ok else 'MISSED'} {r['op']} @{r['elements']:,}: "
                            f"{r['fraction_of_copy']:.0%} of copy (target >= {target:.0%})")
    for n in sorted({r["elements"] for r in rows}):
        plain = next(r for r in rows if r["elements"] == n and r["op"] == "quantize int4")
        swz = next(r for r in rows if r["elements"] == n and r["op"] == "swizzle_quantize int4 (2x4, 2 stages)")
        compiled = plain["compiled_backend"]
        ratio = swz[f"{compiled}_ms"] / plain[f"{compiled}_ms"]
        verdicts.append(f"{'met ' if ratio <= 1.10 else 'MISSED'} swizzle_quantize / quantize int4 @{n:,}: "
                        f"{ratio:.2f} (target <= 1.10)")
        for rotated in (r for r in rows if r["elements"] == n and "Hadamard" in r["op"]):
            base = next(r for r in rows if r["elements"] == n and r["op"] == rotated["op"].split(" + ")[0])
            verdicts.append(f"cost of the rotation: {rotated['op']} @{n:,}: "
                            f"{rotated[f'{compiled}_ms'] / base[f'{compiled}_ms']:.2f}x the time without it")
    return verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default=None, help="comma-separated, e.g. 1M,16M (default: 1M..64M on CPU, "
                                                      "1M..256M on GPU)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default="bench", help="folder for kernels.json and kernels.md")
    parser.add_argument("--label", default="", help="suffix of the output files (another version of the kernels)")
    parser.add_argument("--compiled-only", action="store_true", help="time the compiled kernels, not the reference")
    parser.add_argument("--torchao", action="store_true", help="add torchao's blockwise quantization as an anchor")
    parser.add_argument("--check", action="store_true", help="check every op's output against the reference's")
    args = parser.parse_args()
    device = torch.device(args.device)
    default = "1M,4M,16M,64M" if device.type == "cpu" else "1M,4M,16M,64M,256M"
    sizes = [_parse_size(s) for s in (args.sizes or default).split(",")]
    rows = run(device, sizes, args.dtype, args.reps, args.compiled_only, args.torchao, args.check)
    stem = f"kernels_{device.type}{'_' + args.label if args.label else ''}"
    differing = [f"DIFFERS FROM THE REFERENCE: {r['op']} @{r['elements']:,}" for r in rows
                 if r.get("matches_reference") is False]
    report = markdown(rows) + "\n\n" + "\n".join(f"- {v}" for v in differing + targets(rows)) + "\n"
    save(Path(args.out), stem, rows, report)


if __name__ == "__main__":
    main()
