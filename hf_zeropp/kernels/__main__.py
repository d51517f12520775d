"""``python -m hf_zeropp.kernels build`` compiles the kernels ahead of time (with the compiler's full output);
``python -m hf_zeropp.kernels check`` prints which backend each device uses and checks it against the reference."""

from __future__ import annotations

import argparse
import sys

import torch

from . import (_build, dequant_reduce, dequant_reduce_quant, dequantize, dequantize_allocated, quantize,
               quantize_allocated, swizzle_quantize)


def _devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def build() -> int:
    status = 0
    for name in [_build.CPU_EXTENSION] + ([_build.CUDA_EXTENSION] if torch.cuda.is_available() else []):
        try:
            _build.load(name, verbose=True, raise_on_failure=True)
            print(f"{name}: built")
        except RuntimeError as error:
            print(error, file=sys.stderr)
            status = 1
    if not torch.cuda.is_available():
        print(f"{_build.CUDA_EXTENSION}: skipped (no CUDA device visible to torch)")
    return status


def _self_test(backend: str, device: str) -> list[str]:
    """Compare ``backend`` with the reference on a mixed input; return the names of the ops that differ."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=g)
    x[1, 3], x[2, 0], x[3, :256] = float("nan"), float("inf"), 0.0
    x = x.to(device=device, dtype=torch.bfloat16)
    failures = []

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a.nan_to_num(1234.5), b.nan_to_num(1234.5)) if a.is_floating_point() else torch.equal(a, b)

    for bits in (8, 4):
        for stochastic in (False, True):
            got = quantize(x, bits, 128, stochastic=stochastic, backend=backend)
            ref = quantize(x, bits, 128, stochastic=stochastic, backend="reference")
            if not (same(got.codes, ref.codes) and same(got.scales, ref.scales)):
                failures.append(f"quantize {bits}-bit stochastic={stochastic}")
        back = dequantize(*ref, bits=bits, block_size=128, length=1000, dtype=torch.bfloat16, backend=backend)
        if not same(back, dequantize(*ref, bits=bits, block_size=128, length=1000, dtype=torch.bfloat16,
                                     backend="reference")):
            failures.append(f"dequantize {bits}-bit")
        flat = x[:4].reshape(-1)
        got = swizzle_quantize(flat, 2, 2, 2, bits, 64, backend=backend)
        ref = swizzle_quantize(flat, 2, 2, 2, bits, 64, backend="reference")
        if not (same(got.codes, ref.codes) and same(got.scales, ref.scales)):
            failures.append(f"swizzle_quantize {bits}-bit")
        stacked = quantize(x.float().reshape(3, 2, 1000), bits, 128, backend="reference")
        got = dequant_reduce_quant(*stacked, in_bits=bits, out_bits=4, block_size=128, backend=backend)
        ref = dequant_reduce_quant(*stacked, in_bits=bits, out_bits=4, block_size=128, backend="reference")
        if not (same(got.codes, ref.codes) and same(got.scales, ref.scales)):
            failures.append(f"dequant_reduce_quant {bits}->4-bit")
        got = dequant_reduce(*stacked, bits=bits, block_size=128, scale=0.25, backend=backend)
        if not same(got, dequant_reduce(*stacked, bits=bits, block_size=128, scale=0.25, backend="reference")):
            failures.append(f"dequant_reduce {bits}-bit")
        spread = x.float() * torch.logspace(-4, 4, 1000, device=device)  # blocks of every width
        for stochastic in (False, True):
            got = quantize_allocated(spread, bits, 128, stochastic=stochastic, floor=2, backend=backend)
            ref = quantize_allocated(spread, bits, 128, stochastic=stochastic, floor=2, backend="reference")
            if not (same(got.codes, ref.codes) and same(got.scales, ref.scales)):
                failures.append(f"quantize_allocated {bits}-bit stochastic={stochastic}")
        widths = dict(bits=bits, block_size=128, length=1000, floor=2)
        if not same(dequantize_allocated(*ref, backend=backend, **widths),
                    dequantize_allocated(*ref, backend="reference", **widths)):
            failures.append(f"dequantize_allocated {bits}-bit")
    return failures


def check() -> int:
    from . import active_backend

    status = 0
    for device in _devices():
        backend = active_backend(device)
        failure = _build.failure(_build.CPU_EXTENSION if device == "cpu" else _build.CUDA_EXTENSION)
        note = f" (compiled backend unavailable: {failure.splitlines()[0]})" if failure else ""
        failures = _self_test(backend, device)
        verdict = "self-test passed" if not failures else "self-test FAILED: " + ", ".join(failures)
        print(f"{device}: backend {backend!r}{note}; {verdict}")
        status |= bool(failures)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_zeropp.kernels", description=__doc__)
    parser.add_argument("command", choices=["build", "check"])
    args = parser.parse_args(argv)
    return build() if args.command == "build" else check()


if __name__ == "__main__":
    sys.exit(main())
