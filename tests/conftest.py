"""Fixtures shared by several test modules: the faulty 4-rank runs (a rank SIGKILLed mid-step, another mid-save)
that both ``tests/reliability/test_rank_failures.py`` and ``tests/reliability/test_exact_resume.py`` examine.
Session-scoped, so each run happens once however many of those modules are collected. And the compiles of the CUDA
sources and of their torch binding (``tests/kernels/test_cuda_sources.py``), started in the background when collection
ends, their tests run last. And the one launch of stock scripts given DeepSpeed configs that
``tests/interop/test_deepspeed_training.py`` and ``tests/checkpoint/test_deepspeed_checkpoint.py`` both examine; it and
the other launch fixtures registered with ``tests/background.py`` also start when collection ends."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

import background
from faults import FAULT_AT, SAVE_AT, faulty_run, run_spec
from launching import STOCK_CPU, hf_zeropp_launch
from paths import DEEPSPEED_FIXTURES, LAUNCH_SCRIPTS


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


@background.launches("deepspeed_config_runs")
def _deepspeed_config_launch(work: Path) -> Path:
    runs = json.loads((DEEPSPEED_FIXTURES / "training_runs.json").read_text())
    trainer = DEEPSPEED_FIXTURES / "checkpoints" / "trainer_zero3_bf16_w4"

    def run(script: str, *args) -> str:
        return shlex.join([f"tests/launch_scripts/{script}.py", *map(str, args)])

    def configs(path: str) -> list[Path]:
        return [DEEPSPEED_FIXTURES / "configs" / f"{name}.json" for name in sorted(runs[path])]

    hf_zeropp_launch(
        "--config_file", str(STOCK_CPU), str(LAUNCH_SCRIPTS / "run_each.py"),
        run("deepspeed_trainer", "--deepspeed_configs", *configs("trainer"), "--record", work / "trainer.json",
            "--output_dir", work / "trainer", *runs["trainer_arguments"]),
        run("deepspeed_accelerate", "--deepspeed_configs", *configs("accelerate"),
            "--record", work / "accelerate.json"),
        run("trainer_resumable", "--deepspeed", trainer / "ds_config.json",
            *json.loads((trainer / "arguments.json").read_text()), "--output_dir", work / "resumed",
            "--resume_from_checkpoint", trainer / "checkpoint-6"))
    return work


@pytest.fixture(scope="session")
def deepspeed_config_runs() -> Path:
    """Stock scripts given DeepSpeed configs, under ``hf-zeropp launch`` with the stock 4-process YAML, one after the
    other in one launch (``tests/launch_scripts/run_each.py``: one startup; made in the background,
    tests/background.py): the Trainer script and the Accelerate script once per config of
    tests/fixtures/deepspeed/configs, each writing its record (``trainer.json``, ``accelerate.json``); then the
    Trainer script resumed from DeepSpeed's own ZeRO-3 checkpoint-6 with its own command line (``resumed/``).
    Returns the folder they wrote to."""
    return background.result("deepspeed_config_runs")


# ---------------------------------------------------------------- compiles in the background
# tests/kernels/test_cuda_sources.py compiles each .cu file for sm_80 and sm_90 with nvcc, about 130 CPU-seconds in all,
# and checks the torch binding with g++ against torch's headers, about 10 s: the longest single tests of the suite.
# Those compiles depend on nothing the other tests do, so they start, at the lowest CPU priority, as soon as collection
# ends, and their tests run last and only wait for what is left: the compilers take the CPU time the other tests leave
# idle (a launch's workers waiting for each other, a timeout running out) instead of a stretch of their own. Same
# commands, same sources, same checks as compiling in the tests.
#
# scripts/lowest_priority.sh, in a session of their own: plain nice in pytest's session is not the lowest priority
# where Linux schedules by session.
NVCC = shutil.which("nvcc")
GXX = shutil.which("g++")
_NVCC_TEST = "test_cuda_sources.py::test_cu_files_compile_for_sm80_and_sm90"
_BINDING_TEST = "test_cuda_sources.py::test_cuda_binding_compiles_against_torch_headers"
_compiles: dict[str, tuple[subprocess.Popen, Path]] = {}  # by test id
_not_compiled: dict[str, str] = {}  # test id: why nothing was started (the test skips with it)


def nvcc_command(source: str, output: Path) -> list[str]:
    """nvcc on ``cuda/SOURCE`` with the extension build's flags plus -Wall, for Ampere and Hopper (--threads 0: the
    two arches build in parallel, up to one per CPU)."""
    from hf_zeropp.kernels._build import CUDA_CFLAGS, source_dir

    return [NVCC, "-c", *CUDA_CFLAGS, "-Xcompiler", "-Wall", "--threads", "0",
            "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
            str(source_dir() / source), "-o", str(output)]


def binding_check_command() -> list[str]:
    """g++ -fsyntax-only on cuda/cuda_binding.cpp against the installed torch's headers and CUDA's runtime headers
    (the CPU wheel ships c10/cuda headers but not their generated config header)."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    from hf_zeropp.kernels._build import source_dir

    flags = [f"-I{p}" for p in include_paths()] + [f"-I{_cuda_include()}", f"-I{sysconfig.get_paths()['include']}"]
    return [GXX, "-std=c++17", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=hf_zeropp_cuda_kernels",
            "-DTORCH_API_INCLUDE_EXTENSION_H", "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE", *flags,
            str(source_dir() / "cuda_binding.cpp")]


def _cuda_include() -> Path:
    from torch.utils.cpp_extension import CUDA_HOME

    return Path(CUDA_HOME or "/usr/local/cuda") / "include"


def _compile_test(item) -> str | None:
    name = item.nodeid.split("[")[0]
    return next((test for test in (_NVCC_TEST, _BINDING_TEST) if name.endswith(test)), None)


def _compile_command(item, folder: Path) -> list[str] | str:
    """The command to run for the compile test ``item``, or why it cannot run here."""
    if _compile_test(item) == _NVCC_TEST:
        return nvcc_command(item.callspec.params["source"], folder / "kernels.o") if NVCC else "nvcc is not installed"
    if GXX is None:
        return "g++ is not installed"
    if not (_cuda_include() / "cuda_runtime_api.h").is_file():
        return f"CUDA headers not found under {_cuda_include()}"
    return binding_check_command()


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: _compile_test(item) is not None)  # stable: the compile tests last, the rest in order


def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    for item in session.items:
        if _compile_test(item) is None:
            continue
        folder = Path(tempfile.mkdtemp(prefix="hf_zeropp_compile_"))
        command = _compile_command(item, folder)
        if isinstance(command, str):
            _not_compiled[item.nodeid] = command
            shutil.rmtree(folder)
            continue
        # a file: a pipe nobody reads could fill and stall; a session of its own, to kill it whole
        with open(folder / "output.txt", "w") as output:
            job = subprocess.Popen([*background.LOWEST_PRIORITY, *command], stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        _compiles[item.nodeid] = (job, folder)
    background.start(session.items)


def pytest_sessionfinish():
    background.stop()
    for job, folder in _compiles.values():
        if job.poll() is None:  # the run stopped before its test: the compiler and the processes it started
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def background_compile(request):
    """``background_compile()``: (return code, output, folder) of this test's compile, started when collection
    ended; the test skips where it could not start (no compiler, no headers)."""

    def wait(timeout: float = 900) -> tuple[int, str, Path]:
        if request.node.nodeid in _not_compiled:
            pytest.skip(_not_compiled[request.node.nodeid])
        job, folder = _compiles[request.node.nodeid]
        job.wait(timeout=timeout)
        return job.returncode, (folder / "output.txt").read_text(), folder

    return wait
