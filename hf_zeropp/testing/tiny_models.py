"""Small, seeded transformers models and batches shared by the distributed tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB = 128


def tiny_gpt2(seed: int = 0, n_embd: int = 32, n_layer: int = 2, tie: bool = True):
    """A GPT-2 with tied embeddings; sizes chosen so some weights do not split evenly across 3 ranks."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=n_embd, n_layer=n_layer, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        tie_word_embeddings=tie)
    return GPT2LMHeadModel(config)


def make_optimizer(model) -> torch.optim.AdamW:
    """AdamW with eps=1e-6, lr=1e-3: with eps=1e-8 Adam's first steps turn fp32 reduction-order noise in near-zero
    gradients into full-size updates (±lr), so even one process with a different micro-batch split differs by
    5e-3 relative after 20 steps; with these settings that floor is 2e-6, below the 1e-5 the tests require."""
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)


def global_batch(step: int, size: int = 12, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(1000 + step))


def local_batch(step: int, micro: int = 0, micro_batches: int = 1, size: int = 12) -> torch.Tensor:
    """This rank's slice of micro-batch ``micro`` of the global batch of ``step``."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    ids = global_batch(step, size)
    return ids.chunk(micro_batches)[micro].chunk(world)[rank]


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def train(model, optimizer, steps: range, micro_batches: int = 1, size: int = 12, accumulate=None) -> list[float]:
    """AdamW-style loop; with ``accumulate`` (a no_sync context factory) the first micro-batches don't sync."""
    import contextlib

    losses = []
    for step in steps:
        total = 0.0
        for micro in range(micro_batches):
            ids = local_batch(step, micro, micro_batches, size)
            last = micro == micro_batches - 1
            context = accumulate() if (accumulate is not None and not last) else contextlib.nullcontext()
            with context:
                loss = model(input_ids=ids, labels=ids).loss / micro_batches
                loss.backward()
            total += mean_over_ranks(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Unsharded parameters by name (collective for sharded models)."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for name, p in model.named_parameters()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def save_tiny_gpt2_with_tokenizer(directory) -> None:
    """A tiny GPT-2 and the offline stdlib tokenizer, saved so that TRL can load them — and, from the same path,
    build its reference model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_zeropp.testing.corpus import stdlib_tokenizer

    tokenizer = stdlib_tokenizer(300)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    GPT2LMHeadModel(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def with_stored_int8_values(model, world: int, block_size: int):
    """``model`` with every frozen matrix replaced, in place, by the value hf_zeropp's INT8 store holds for it on
    ``world`` ranks (the flat weight cut into ``world`` equal rows, blocks of ``block_size`` along each): the stock
    model that a sharded ``quantized_nontrainable_weights`` model must equal. The output head (and an embedding
    tied to it) stays full precision, as in the store."""
    import hf_zeropp.kernels as K

    head = model.get_output_embeddings().weight
    for parameter in model.parameters():
        if parameter.requires_grad or parameter.dim() < 2 or parameter is head:
            continue
        n = parameter.numel()
        shard = -(-n // world)
        rows = torch.zeros(world * shard, device=parameter.device)
        rows[:n] = parameter.detach().reshape(-1)
        codes, scales = K.quantize(rows.view(world, shard), 8, block_size, backend="reference")
        restored = K.dequantize(codes, scales, bits=8, block_size=block_size, length=shard, backend="reference")
        parameter.data.copy_(restored.reshape(-1)[:n].view(parameter.shape))
    return model
