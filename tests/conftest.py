"""Fixtures shared by several test modules: the faulty 4-rank runs (a rank SIGKILLed mid-step, another mid-save)
that both ``tests/test_rank_failures.py`` and ``tests/test_exact_resume.py`` examine. Session-scoped, so each run
happens once however many of those modules are collected. And nvcc's compiles of the CUDA sources
(``tests/test_cuda_sources.py``), started in the background when collection ends, their tests run last."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

from faults import FAULT_AT, SAVE_AT, faulty_run, run_spec


@pytest.fixture(scope="session")
def resume_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("resume")


@pytest.fixture(scope="session")
def killed_mid_step(resume_dir):
    """ZeRO-3: rank 2 SIGKILLs itself inside the forward of step 16 (index 15)."""
    work = resume_dir / "killed_mid_step"
    return faulty_run(work, run_spec("stage3", work / "stage3", work / "stage3.json",
                                     kill={"rank": 2, "step": FAULT_AT, "where": "forward"}))


@pytest.fixture(scope="session")
def killed_mid_save(resume_dir):
    """ZeRO++: rank 1 SIGKILLs itself while checkpoint-15 is saved, right after its DCP shard file was written."""
    work = resume_dir / "killed_mid_save"
    return faulty_run(work, run_spec("zeropp", work / "zeropp", work / "zeropp.json", save_at=[SAVE_AT, FAULT_AT],
                                     kill={"rank": 1, "step": FAULT_AT, "where": "dcp_write"}))


# ---------------------------------------------------------------- nvcc in the background
# tests/test_cuda_sources.py compiles each .cu file for sm_80 and sm_90 with nvcc, about 130 CPU-seconds in all: the
# longest single test of the suite. Those compiles depend on nothing the other tests do, so they start, at the lowest
# CPU priority, as soon as collection ends, and their tests run last and only wait for what is left: nvcc takes the
# CPU time the other tests leave idle (a launch's workers waiting for each other, a timeout running out) instead of
# a stretch of its own. Same command, same sources, same checks as compiling in the test.
NVCC = shutil.which("nvcc")
_NVCC_TEST = "test_cuda_sources.py::test_cu_files_compile_for_sm80_and_sm90"
_nvcc_jobs: dict[str, tuple[subprocess.Popen, Path]] = {}


def nvcc_command(source: str, output: Path) -> list[str]:
    """nvcc on ``cuda/SOURCE`` with the extension build's flags plus -Wall, for Ampere and Hopper (--threads 0: the
    two arches build in parallel, up to one per CPU)."""
    from hf_zeropp.kernels._build import CUDA_CFLAGS, source_dir

    return [NVCC, "-c", *CUDA_CFLAGS, "-Xcompiler", "-Wall", "--threads", "0",
            "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
            str(source_dir() / source), "-o", str(output)]


def _is_nvcc_test(item) -> bool:
    return item.nodeid.split("[")[0].endswith(_NVCC_TEST)


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(items):
    items.sort(key=_is_nvcc_test)  # stable: the nvcc tests last, everything else in its order


def pytest_collection_finish(session):
    if NVCC is None or session.config.option.collectonly:
        return
    for item in session.items:
        if _is_nvcc_test(item):
            source = item.callspec.params["source"]
            folder = Path(tempfile.mkdtemp(prefix="hf_zeropp_nvcc_"))
            # a file: a pipe nobody reads could fill and stall. A process group of its own (to kill it whole) but
            # pytest's session: a session of its own would be a scheduler autogroup of its own, which Linux shares
            # the CPU with as with pytest's whole group, whatever nvcc's nice value
            with open(folder / "output.txt", "w") as output:
                job = subprocess.Popen(["nice", "-n", "19", *nvcc_command(source, folder / "kernels.o")],
                                       stdout=output, stderr=subprocess.STDOUT, process_group=0)
            _nvcc_jobs[source] = (job, folder)


def pytest_sessionfinish():
    for job, folder in _nvcc_jobs.values():
        if job.poll() is None:  # the run stopped before its test: nvcc and the compilers it started
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def nvcc_compiled():
    """``nvcc_compiled(source)``: (return code, output, object file) of the background compile of ``source``."""

    def wait(source: str, timeout: float = 900) -> tuple[int, str, Path]:
        job, folder = _nvcc_jobs[source]
        job.wait(timeout=timeout)
        return job.returncode, (folder / "output.txt").read_text(), folder / "kernels.o"

    return wait
