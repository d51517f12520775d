"""The empty model ``hf_zeropp.from_pretrained`` shards (hf_zeropp/engine/skeleton.py) against stock
``from_pretrained``: the same tensor names, shapes and dtypes, mode, generation config and Hub-kernel state, for every
way the dtype is chosen; and a model kernelized by transformers' default trains sharded exactly as stock DDP trains
it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_zeropp.interop.hf_checkpoint import SafetensorsFolder
from hf_zeropp.engine.skeleton import build_skeleton
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import VOCAB


def _layout(model: torch.nn.Module) -> dict[str, tuple]:
    return {name: (tuple(tensor.shape), tensor.dtype) for name, tensor in model.state_dict().items()}


def _save(directory: Path) -> dict[str, Path]:
    from transformers import (GenerationConfig, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, T5Config,
                              T5ForConditionalGeneration)

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    gpt2.generation_config = GenerationConfig(max_length=7, bos_token_id=0, eos_token_id=0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                             num_heads=2, decoder_start_token_id=0))
    paths = {"gpt2": directory / "gpt2", "llama_bf16": directory / "llama_bf16", "t5": directory / "t5"}
    gpt2.save_pretrained(paths["gpt2"])
    llama.to(torch.bfloat16).save_pretrained(paths["llama_bf16"])
    t5.save_pretrained(paths["t5"])
    return paths


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    return _save(tmp_path_factory.mktemp("skeleton"))


@pytest.mark.parametrize("name, model_class, kwargs", [
    ("gpt2", "AutoModelForCausalLM", {}),
    ("gpt2", "GPT2LMHeadModel", {"dtype": torch.bfloat16}),
    ("gpt2", "AutoModelForCausalLM", {"dtype": "float16", "use_kernels": False}),
    ("llama_bf16", "AutoModelForCausalLM", {}),  # "auto": the config's bfloat16
    ("llama_bf16", "LlamaForCausalLM", {"dtype": "auto", "attn_implementation": "eager"}),
    ("llama_bf16", "AutoModelForSequenceClassification", {"num_labels": 3, "dtype": torch.float32}),
    ("t5", "T5ForConditionalGeneration", {"dtype": torch.float16}),  # _keep_in_fp32_modules: "wo" stays float32
    ("t5", "AutoModelForSeq2SeqLM", {"dtype": torch.bfloat16}),
])
def test_the_skeleton_has_the_names_shapes_dtypes_and_state_stock_loading_gives(saved, name, model_class, kwargs):
    import transformers

    cls = getattr(transformers, model_class)
    stock = cls.from_pretrained(saved[name], **kwargs)
    empty = build_skeleton(cls, saved[name], SafetensorsFolder(saved[name]), **kwargs)
    assert all(tensor.is_meta for tensor in empty.parameters())
    assert type(empty) is type(stock)
    assert _layout(empty) == _layout(stock)
    assert empty.training == stock.training is False
    assert empty.use_kernels == stock.use_kernels
    assert empty.config._attn_implementation == stock.config._attn_implementation
    assert empty.generation_config.to_dict() == stock.generation_config.to_dict() if stock.can_generate() else True
    if name == "t5" and kwargs["dtype"] == torch.float16:
        assert stock.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32  # the case is real


def test_what_the_skeleton_cannot_honour_is_refused_naming_the_argument(saved):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with pytest.raises(ValueError, match=r"quantization_config \(given a BitsAndBytesConfig\).*hf_zeropp.shard_model"):
        build_skeleton(AutoModelForCausalLM, saved["gpt2"], None, quantization_config=BitsAndBytesConfig())
    with pytest.raises(ValueError, match="dtype='float17' is not a torch dtype"):
        build_skeleton(AutoModelForCausalLM, saved["gpt2"], None, dtype="float17")


def _train_both_ways(path: str, use_kernels: bool | None) -> dict:
    """Stock: every rank loads with ``from_pretrained`` (Hub kernels as transformers decides), DDP; hf_zeropp: the
    model read in slices, zero3. Four AdamW steps, each rank on its own batch; the losses and final weights."""
    from torch.nn.parallel import DistributedDataParallel
    from transformers import AutoModelForCausalLM

    import hf_zeropp
    from hf_zeropp.testing.tiny_models import full_parameters

    kwargs = {"dtype": torch.float32, **({} if use_kernels is None else {"use_kernels": use_kernels})}
    results = {}
    for way in ("stock", "zero3"):
        if way == "stock":
            loaded = AutoModelForCausalLM.from_pretrained(path, **kwargs)
            model = DistributedDataParallel(loaded)
        else:
            loaded = hf_zeropp.from_pretrained(AutoModelForCausalLM, path, **kwargs)
            model = hf_zeropp.shard_model(loaded, "zero3")
        kernelized = loaded.use_kernels
        loaded.train()  # re-kernelizes for training mode where kernels are on (transformers' kernels_mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(4):
            ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        weights = (full_parameters(model) if way == "zero3"
                   else {n: p.detach().clone() for n, p in loaded.named_parameters()})
        results[way] = {"losses": losses, "weights": weights, "kernelized": kernelized,
                        "mode": str(getattr(loaded, "kernels_mode", None))}
    return results


def _train_with_and_without_kernels(path: str) -> dict:
    return {use_kernels: _train_both_ways(path, use_kernels) for use_kernels in (None, False)}


def test_a_model_kernelized_by_default_trains_sharded_as_stock_ddp_trains_it(saved):
    """transformers' default Hub kernels, and ``use_kernels=False``, each the same under stock DDP and zero3."""
    from hf_zeropp._compat import hub_kernels_by_default

    for rank in run_distributed(_train_with_and_without_kernels, 2, str(saved["llama_bf16"])):
        for use_kernels, ways in rank.items():
            stock, ours = ways["stock"], ways["zero3"]
            expected = hub_kernels_by_default() if use_kernels is None else False
            assert stock["kernelized"] == ours["kernelized"] == expected, use_kernels
            assert stock["mode"] == ours["mode"]
            assert stock["losses"] == pytest.approx(ours["losses"], rel=1e-6, abs=0)
            assert stock["losses"][-1] < stock["losses"][0]
            for name, weight in stock["weights"].items():
                assert torch.equal(ours["weights"][name], weight), (use_kernels, name)
