"""``--compile BACKEND`` of the step benchmarks (:mod:`.step_cpu`, :mod:`.cluster`): every hf_zeropp configuration runs
twice in the same launch, eager and with its FSDP units compiled by ``hf_zeropp.compile_units`` with that
``torch.compile`` backend (what the Trainer's ``--torch_compile`` and Accelerate's dynamo settings do), the compiled
run named apart in the tables."""

from __future__ import annotations

import argparse

from torch import nn

from hf_zeropp import compile_units


def add_compile_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile", metavar="BACKEND",
                        help="also run each configuration with its FSDP units compiled by this torch.compile backend "
                             "(inductor, aot_eager, ...), beside the eager run in the same launch")


def eager_and_compiled(names: list[str], backend: str | None) -> list[tuple[str, str | None]]:
    """(configuration, backend) pairs: each configuration eager (backend None), then compiled where asked."""
    backends = [None] if backend is None else [None, backend]
    return [(name, each) for name in names for each in backends]


def run_name(name: str, backend: str | None) -> str:
    return name if backend is None else f"{name} compiled ({backend})"


def compile_if_asked(model: nn.Module, backend: str | None) -> None:
    """Compile the sharded ``model``'s units with ``backend`` (None: leave it eager)."""
    if backend is not None:
        compile_units(model, backend=backend)
