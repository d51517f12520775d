"""The multi-rank ZeRO++ path with ranks as threads of one process (hf_zeropp.testing.threaded_ranks): on CPU it
must equal gloo processes bit for bit, which qualifies the harness; on one GPU, with a CUDA stream per rank, it
must equal the CPU run (bit for bit where only hf_zeropp's kernels compute, within the quantization of a rounding
flip where CUDA's matrix products differ from the CPU's), and under torch's CUDA stream sanitizer no rank may read
a buffer before the stream that writes it is done."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.threaded_ranks import run_threaded

NODES, NODE_SIZE = 2, 2
WORLD = NODES * NODE_SIZE
SEQ, STEPS, LR = 32, 3, 0.05
CONFIGS = {
    "zero3": {"stage": 3, "node_size": NODE_SIZE},
    "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node", "quantized_gradients": True,
               "node_size": NODE_SIZE},
}
SHARD, BLOCK = 301, 64  # elements per rank in the direct collective check: neither stages nor blocks divide it

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _initial_state() -> dict[str, torch.Tensor]:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(_gpt2_config()).state_dict()


def _gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _train(options: dict, device: str, state: dict[str, torch.Tensor]) -> dict:
    """STEPS SGD steps of a 2-layer GPT-2 under ``options`` on ``device``: this rank's losses, gradient shards
    after the first backward, and parameter shards at the end (on CPU)."""
    import hf_zeropp
    from transformers import GPT2LMHeadModel

    torch.backends.cuda.matmul.allow_tf32 = False
    rank = dist.get_rank()
    with torch.device("meta"):
        model = GPT2LMHeadModel(_gpt2_config())
    model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=True)  # same weights on every rank
    hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**options), device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    batches = torch.Generator().manual_seed(rank)
    losses, first_gradients = [], None
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (4, SEQ), generator=batches).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if first_gradients is None:
            first_gradients = [p.grad.to_local().detach().cpu().clone() for p in model.parameters()]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().cpu())
    return {"losses": torch.stack(losses), "gradients": first_gradients,
            "parameters": [p.to_local().detach().cpu().clone() for p in model.parameters()],
            "implementations": hf_zeropp.comm_stats(model)["implementations"]}


def _collectives(device: str) -> dict[str, torch.Tensor]:
    """qgZ's 2-hop reduce-scatter (INT4, 2 stages, stochastic rounding) and qwZ's INT8 all-gather of fixed inputs:
    only hf_zeropp's kernels compute, so every device must give the same bits."""
    from hf_zeropp.comm.comm_meter import CommMeter
    from hf_zeropp.config.config import ZeroPPConfig
    from hf_zeropp.comm.qgz import QuantizedReduceScatter
    from hf_zeropp.comm.qwz import QuantizedAllGather
    from hf_zeropp.comm.topology import get_topology

    topology = get_topology(ZeroPPConfig(node_size=NODE_SIZE), device)
    meter = CommMeter(topology)
    rank = dist.get_rank()
    inputs = torch.Generator().manual_seed(100 + rank)
    gradients = (torch.randn(WORLD * SHARD, generator=inputs) * torch.rand(WORLD * SHARD, generator=inputs) ** 4)
    shard = torch.empty(SHARD, device=device)
    reduce_scatter = QuantizedReduceScatter(meter, topology, 4, 4, BLOCK, 2, True, 7)
    reduce_scatter(shard, gradients.to(device), dist.group.WORLD, dist.ReduceOp.SUM)
    gathered = torch.empty(WORLD * SHARD, device=device)  # FSDP's layout: the input is a view into the output
    gathered.view(WORLD, SHARD)[rank].copy_(torch.randn(SHARD, generator=inputs))
    QuantizedAllGather(meter, topology, 8, BLOCK, quantize_node_local=False)(
        gathered, gathered.view(WORLD, SHARD)[rank], dist.group.WORLD)
    return {"qgz_shard": shard.cpu(), "qwz_gathered": gathered.cpu()}


def _both(device: str, state: dict) -> dict:
    return {"runs": {name: _train(options, device, state) for name, options in CONFIGS.items()},
            "collectives": _collectives(device)}


@pytest.fixture(scope="module")
def cpu_threads():
    return run_threaded(_both, WORLD, "cpu", _initial_state())


def test_threaded_ranks_on_cpu_equal_gloo_processes(cpu_threads):
    """The harness changes nothing but where ranks run: qgZ's and qwZ's results are the same bits, and so is every
    gradient that only hf_zeropp's collectives sum (ZeRO++'s matrices). Sums that the process group itself does
    (the plain reduce-scatter) add in another order: equal to fp32 rounding."""
    processes = run_distributed(_both, WORLD, "cpu", _initial_state(), node_size=NODE_SIZE)
    for rank in range(WORLD):
        threads, reference = cpu_threads[rank], processes[rank]
        for key, value in reference["collectives"].items():
            assert torch.equal(threads["collectives"][key], value), f"rank {rank}: {key} differs"
        for name in CONFIGS:
            got, expected = threads["runs"][name], reference["runs"][name]
            assert float(got["losses"][0]) == float(expected["losses"][0]), f"rank {rank} {name}"
            torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-5, atol=0)
            for threaded, spawned in zip(got["gradients"], expected["gradients"]):
                if name == "zeropp" and threaded.dim() == 2:
                    assert torch.equal(threaded, spawned), f"rank {rank}: a qgZ gradient differs"
                torch.testing.assert_close(threaded, spawned, rtol=1e-5, atol=1e-8)
    implementations = cpu_threads[0]["runs"]["zeropp"]["implementations"]
    assert "qwZ int8" in implementations["fwd_allgather"][0] and "2x2" in implementations["qgz_inter"][0]


def _cuda_threads(state: dict) -> list[dict]:
    from torch.cuda import _sanitizer

    sanitizer = _sanitizer.cuda_sanitizer.dispatch if _sanitizer.cuda_sanitizer.enabled else None
    torch.cuda.set_device(0)
    return run_threaded(_both, WORLD, "cuda", state, own_streams=True, sanitizer=sanitizer)


@needs_cuda
def test_zeropp_on_four_cuda_ranks_of_one_gpu_equals_the_cpu_run(cpu_threads):
    """4 ranks (2 nodes x 2) on one GPU, each on its own stream."""
    cuda = _cuda_threads(_initial_state())
    for rank in range(WORLD):
        for key, value in cpu_threads[rank]["collectives"].items():
            assert torch.equal(cuda[rank]["collectives"][key], value), f"rank {rank}: {key} differs from CPU"
        assert "kernels cuda" in " ".join(cuda[rank]["runs"]["zeropp"]["implementations"]["qgz_inter"])
        for name in CONFIGS:
            got, expected = cuda[rank]["runs"][name], cpu_threads[rank]["runs"][name]
            torch.testing.assert_close(got["losses"], expected["losses"], rtol=1e-4, atol=1e-5)
            for cuda_grad, cpu_grad in zip(got["gradients"], expected["gradients"]):
                difference = (cuda_grad - cpu_grad).abs()
                scale = cpu_grad.abs().max().clamp_min(1e-12)
                if name == "zero3":  # fp32 sums of the same products in another order
                    assert float(difference.max() / scale) < 1e-4, f"rank {rank} {name}: gradients differ"
                else:  # an INT4 code may round the other way where the products differ in the last bits
                    flipped = float((difference > 1e-3 * scale).float().mean())
                    assert flipped < 0.02 and float(difference.max() / scale) < 0.5, (
                        f"rank {rank} {name}: {flipped:.2%} of gradient elements differ beyond rounding")
            for cuda_param, cpu_param in zip(got["parameters"], expected["parameters"]):
                torch.testing.assert_close(cuda_param, cpu_param, rtol=0, atol=LR * STEPS * 0.05)


under_the_sanitizer = pytest.mark.skipif(os.environ.get("TORCH_CUDA_SANITIZER") != "1",
                                         reason="run with TORCH_CUDA_SANITIZER=1")


@needs_cuda
@under_the_sanitizer
def test_four_cuda_ranks_of_zeropp_pass_the_stream_sanitizer():
    """The same steps on the 4 CUDA ranks with torch's stream sanitizer in every rank thread: a rank that reads a
    buffer before the stream writing it is done (or writes one another stream still reads) fails."""
    for rank, result in enumerate(_cuda_threads(_initial_state())):
        for name in CONFIGS:
            assert bool(torch.isfinite(result["runs"][name]["losses"]).all()), f"rank {rank} {name}"


@needs_cuda
@under_the_sanitizer
def test_the_sanitizer_is_active_in_every_rank_thread():
    """The check above means something under the sanitizer only if every rank thread runs under it: a read on one
    stream of what another stream wrote, without a wait, must fail a rank."""
    def unsynchronised_read():
        written = torch.zeros(1 << 20, device="cuda")
        with torch.cuda.stream(torch.cuda.Stream()):
            written.add_(1)
        return float(written.sum())  # the rank's own stream reads without waiting for the side stream

    with pytest.raises(RuntimeError, match="CUDASanitizerErrors|data race"):
        _cuda_threads_of(unsynchronised_read)


def _cuda_threads_of(fn) -> list:
    from torch.cuda import _sanitizer

    torch.cuda.set_device(0)
    return run_threaded(fn, WORLD, own_streams=True, sanitizer=_sanitizer.cuda_sanitizer.dispatch)


def test_gpu_step_benchmark_trains_its_presets_on_cpu_threads(tmp_path, monkeypatch):
    """scripts/benchmarks/gpu_ranks_step.py (the GPU check's real-model step) in its CPU dry run: each preset
    trains on four rank threads with equal shards, and only ZeRO++ runs qwZ and qgZ."""
    import json
    import sys

    from scripts.benchmarks import gpu_ranks_step

    monkeypatch.setattr(sys, "argv", ["gpu_ranks_step", "--device", "cpu", "--hidden", "64", "--layers", "2",
                                      "--vocab", "256", "--seq", "32", "--batch", "2", "--warmup", "1", "--steps", "1",
                                      "--configs", "ZeRO-3,ZeRO++", "--out", str(tmp_path)])
    gpu_ranks_step.main()
    results = json.loads((tmp_path / "gpu_ranks_step.json").read_text())["results"]
    for name, result in results.items():
        assert "error" not in result, (name, result.get("traceback"))
        assert result["step_ms"] > 0 and all(loss == loss for loss in result["last_loss"])
        assert len(set(result["rank_state_gib"])) == 1 and result["rank_state_gib"][0] > 0
    described = {name: json.dumps(result["implementations"]) for name, result in results.items()}
    assert "qwZ" in described["ZeRO++"] and "qgZ" in described["ZeRO++"]
    assert "qwZ" not in described["ZeRO-3"] and "qgZ" not in described["ZeRO-3"]
    assert results["ZeRO++"]["profile"]["hf_zeropp_seconds"] > 0
