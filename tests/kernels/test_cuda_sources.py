"""The CUDA kernels compile for Ampere and Hopper wherever nvcc exists, and their torch binding compiles against
the installed torch headers; on a GPU the kernels are checked bit for bit against the reference in
test_kernels.py (the "cuda" backend rows)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_zeropp.kernels._build import source_dir


@pytest.mark.parametrize("source", sorted(p.name for p in source_dir().glob("*.cu")))
def test_cu_files_compile_for_sm80_and_sm90(source, background_compile):
    """nvcc with the extension build's flags and -Wall, for sm_80 and sm_90 (tests/conftest.py's ``nvcc_command``):
    started in the background when collection ended, at the lowest priority; this test runs last and waits for it."""
    returncode, output, folder = background_compile()
    assert returncode == 0, output
    assert (folder / "kernels.o").stat().st_size > 0


def test_cu_files_are_free_of_torch_headers():
    for path in source_dir().glob("*.cu*"):
        text = path.read_text()
        assert "torch/" not in text and "ATen/" not in text and "c10/" not in text, path.name


def test_cuda_binding_compiles_against_torch_headers(background_compile):
    """g++ -fsyntax-only on the binding against the installed torch's headers (tests/conftest.py's
    ``binding_check_command``), in the background as the nvcc compiles."""
    returncode, output, _ = background_compile()
    assert returncode == 0, output[-4000:]


def test_objects_compiled_ahead_are_refused_for_other_sources_or_without_a_gpu(tmp_path):
    """scripts/cuda_objects.py links kernels compiled on a machine without a GPU; objects of other sources must never
    be linked under this version's build name, and linking needs the GPU machine."""
    from scripts.cuda_objects import MANIFEST, _digests, link_objects

    digests = _digests()
    assert {"quant_kernels.cu", "allocation_kernels.cu", "quant_kernels.h"} <= set(digests)
    stale = dict(digests, **{"quant_kernels.h": "0" * 64})
    (tmp_path / MANIFEST).write_text(json.dumps({"arch": "90", "sources": stale}))
    link = [sys.executable, "-m", "scripts.cuda_objects", "link", str(tmp_path)]
    refused = subprocess.run(link, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "other versions of quant_kernels.h" in refused.stderr, refused.stderr
    if not torch.cuda.is_available():  # the command line is the one above; its link step, here without a process
        (tmp_path / MANIFEST).write_text(json.dumps({"arch": "90", "sources": digests}))
        with pytest.raises(SystemExit, match="no CUDA device"):
            link_objects(tmp_path)
