"""How low can qgZ's per-step gradient error go at the inter-node hop's bytes?

    python -m scripts.experiments.quantizer_floor [--fidelity docs/results/2026-11-23-fidelity-gpt2.md ...] [--bits 4.125]

The inter-node hop carries 4 bits per value plus one fp32 scale per 256 values: 4.125 bits. After a Hadamard
rotation the values of a block are close to Gaussian (the measured error of Hadamard 64 + 8-bit intra matches the
Gaussian model below to a few percent), so the rate-distortion theory of a Gaussian source bounds what any
quantizer could do with those bits. Each row is the relative RMS error on N(0, 1) values, computed exactly where
theory gives it and with hf_zeropp's own reference quantizer where the format is ours:

* hf_zeropp's INT4 absmax format (block 256, and block 64 for comparison) on seeded Gaussian values;
* the best fixed-length scalar quantizer with 16 levels (Lloyd-Max, exact centroid iteration on the Gaussian
  density; it is also given its scale for free, so it is a lower bound for every 4-bit codebook with a scale);
* uniform cells whose indices an ideal entropy coder sends at the budget (variable-length per block);
* Shannon's bound 2^-R for a Gaussian source at R bits.

With ``--fidelity`` each gradient table of those reports gets a column: plain ZeRO++'s measured error over the error
Hadamard 64 + 8-bit intra would leave if its inter-node hop used that row's quantizer — the most any quantizer of
the kind could gain per step over plain ZeRO++ at the same cross-node bytes.

The model is one stationary Gaussian source: every block alike, each given the same bits. The blocks of a real
gradient row are not alike — their scales spread over orders of magnitude — and a code that gives each block its
own width from the scales it already sends (``gradient_bit_allocation``, :mod:`hf_zeropp.kernels.allocation`) is
not bounded by these rows: it gains on the spread between blocks, which this model leaves out.
"""

from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch

from hf_zeropp.kernels import reference

PLAIN_ROW = "ZeRO++ qgZ (int4/int4, block 256)"
BEST_ROW = "Hadamard 64 + 8-bit intra"
SCALE_BITS = 32


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtr(x)


def _normal_pdf(x: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _cells(edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probability and centroid of N(0, 1) in each cell between consecutive ``edges`` (first -inf, last +inf)."""
    probability = _normal_cdf(edges[1:]) - _normal_cdf(edges[:-1])
    mass = _normal_pdf(edges[:-1]) - _normal_pdf(edges[1:])  # integral of x * pdf over the cell
    centroid = torch.where(probability > 0, mass / probability.clamp_min(1e-300), torch.zeros_like(mass))
    return probability, centroid


def _centroid_mse(probability: torch.Tensor, centroid: torch.Tensor) -> float:
    """E[(x - q(x))^2] when every cell reconstructs to its centroid: E[x^2] - sum p c^2, with E[x^2] = 1."""
    return float(1 - (probability * centroid * centroid).sum())


def lloyd_max_mse(levels: int, iterations: int = 2000) -> float:
    """Mean squared error of the optimal ``levels``-level scalar quantizer of N(0, 1) (Lloyd-Max)."""
    codebook = torch.linspace(-2.5, 2.5, levels, dtype=torch.float64)
    infinity = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(iterations):
        edges = torch.cat((-infinity, (codebook[1:] + codebook[:-1]) / 2, infinity))
        probability, codebook = _cells(edges)
    return _centroid_mse(probability, codebook)


def entropy_coded_uniform(step: float, span: float = 12.0) -> tuple[float, float]:
    """(entropy in bits, mean squared error) of uniform cells of width ``step`` centred on 0, centroid reconstruction."""
    half = math.ceil(span / step)
    centres = torch.arange(-half, half + 1, dtype=torch.float64) * step
    infinity = centres.new_tensor([math.inf])
    edges = torch.cat((-infinity, centres[1:] - step / 2, infinity))
    probability, centroid = _cells(edges)
    used = probability[probability > 0]
    return float(-(used * used.log2()).sum()), _centroid_mse(probability, centroid)


def entropy_coded_mse(bits: float) -> float:
    """Mean squared error of uniform cells whose entropy equals ``bits`` (bisection on the cell width)."""
    narrow, wide = 1e-3, 4.0
    for _ in range(100):
        step = (narrow + wide) / 2
        entropy, mse = entropy_coded_uniform(step)
        narrow, wide = (step, wide) if entropy > bits else (narrow, step)
    return mse


def absmax_format_error(bits: int, block_size: int, values: int = 1 << 22, seed: int = 0) -> float:
    """Relative L2 error of hf_zeropp's block format (reference quantizer) on seeded N(0, 1) values."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(values // 4096, 4096, generator=generator)
    codes, scales = reference.quantize(x, bits, block_size)
    back = reference.dequantize(codes, scales, bits, block_size, x.shape[-1], torch.float32)
    return float((back - x).double().norm() / x.double().norm())


def floor_rows(bits: float) -> list[tuple[str, float, float]]:
    """(quantizer, bits per value, relative error on N(0, 1)) from our format down to Shannon's bound."""
    return [
        ("hf_zeropp INT4 absmax, block 256 (what the hop sends)", 4 + SCALE_BITS / 256, absmax_format_error(4, 256)),
        ("hf_zeropp INT4 absmax, block 64 (more bytes)", 4 + SCALE_BITS / 64, absmax_format_error(4, 64)),
        ("best 16-level codebook (Lloyd-Max), scale free", 4.0, math.sqrt(lloyd_max_mse(16))),
        (f"uniform cells + ideal entropy coder at {bits:g} bits", bits, math.sqrt(entropy_coded_mse(bits))),
        (f"Shannon bound at {bits:g} bits", bits, 2.0 ** -bits),
    ]


def measured_errors(path: Path) -> list[tuple[str, float, float]]:
    """(gradient table heading, plain ZeRO++'s error, Hadamard 64 + 8-bit intra's error) from a fidelity report: the
    "all" column of each unweighted gradient table."""
    found, heading, values = [], "", {}
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            if PLAIN_ROW in values and BEST_ROW in values:
                found.append((heading, values[PLAIN_ROW], values[BEST_ROW]))
            heading, values = line.lstrip("# "), {}
        elif line.startswith("| ") and "gradients (qgZ result" in heading:
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            if cells[0] in (PLAIN_ROW, BEST_ROW):
                values[cells[0]] = float(re.match(r"[0-9.]+", cells[5]).group())
    if PLAIN_ROW in values and BEST_ROW in values:
        found.append((heading, values[PLAIN_ROW], values[BEST_ROW]))
    if not found:
        raise ValueError(f"{path} holds no gradient table with the rows {PLAIN_ROW!r} and {BEST_ROW!r}; pass a "
                         "report written by scripts/experiments/fidelity/")
    return found


def markdown(bits: float, fidelity: list[Path]) -> str:
    """The floor table; per measured case, plain ZeRO++'s error over the error the hop would leave with each
    quantizer: the measured Hadamard 64 + 8-bit intra error times that quantizer's error over our format's (both on
    Gaussian values), which carries over how the case's node partials add up."""
    rows = floor_rows(bits)
    format_error = rows[0][2]
    cases = [(f"{path.name}: {heading.split(':')[0]}", plain, best) for path in fidelity
             for heading, plain, best in measured_errors(path)]
    header = "| quantizer | bits/value | relative error on N(0,1) |" + "".join(
        f" plain ZeRO++'s error / this, {case} |" for case, _, _ in cases)
    lines = [header, "|---|---:|---:|" + "---:|" * len(cases)]
    for name, row_bits, error in rows:
        lines.append(f"| {name} | {row_bits:.3f} | {error:.4f} |" + "".join(
            f" {plain / (best * error / format_error):.2f}x |" for _, plain, best in cases))
    lines.append("")
    lines += [f"* {case}: plain ZeRO++ {plain:.4f}, Hadamard 64 + 8-bit intra {best:.4f} ({plain / best:.2f}x); "
              f"3x lower is {plain / 3:.4f}" for case, plain, best in cases]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bits", type=float, default=4 + SCALE_BITS / 256,
                        help="bits per value the inter-node hop may spend (default: INT4 + fp32 scale per 256)")
    parser.add_argument("--fidelity", type=Path, nargs="*", default=[],
                        help="reports of scripts.experiments.fidelity whose plain ZeRO++ error the floors are compared to")
    args = parser.parse_args(argv)
    print(markdown(args.bits, args.fidelity))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
