"""Models larger than one rank (docs/large-models.md): a model built on the meta device is initialised shard by
shard exactly as its own init does on the full model; a model only rank 0 loads reaches every rank's shards; frozen
INT8 weights are quantized from the loaded values; placements that cannot work fail on every rank with the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import VOCAB, full_parameters, save_tiny_gpt2_with_tokenizer

CONFIGS = {"ddp": {"stage": 0}, "zero1": {"stage": 1}, "zero2": {"stage": 2}, "zero3": {"stage": 3},
           "zeropp": {"stage": 3, "quantized_weights": True, "hpz_partition_size": "node",
                      "quantized_gradients": True}}


def _gpt2_config(tie: bool):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                      eos_token_id=0, tie_word_embeddings=tie)


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)


class PlainNet(nn.Module):
    """No transformers: every module initialises itself with reset_parameters, in construction order."""

    _no_split_modules = ["Block"]

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 24)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(24, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(input_ids)))


class BufferedNet(PlainNet):
    """A plain model with a constant buffer its init never touches: accelerate's init_empty_weights keeps it real."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 24), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(input_ids) * self.scale))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(24)
        self.mlp = nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def _build(family: str):
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    return {"gpt2_tied": lambda: GPT2LMHeadModel(_gpt2_config(tie=True)),
            "llama": lambda: LlamaForCausalLM(_llama_config()),
            "plain": PlainNet, "plain_real_buffers": BufferedNet}[family]()


def _build_empty(family: str):
    """On the meta device: everything under torch.device("meta"); with accelerate's init_empty_weights the
    parameters only (buffers stay real)."""
    from accelerate import init_empty_weights

    with init_empty_weights() if family == "plain_real_buffers" else torch.device("meta"):
        return _build(family)


def _eager_reference(family: str, seed: int) -> nn.Module:
    """The model built eagerly, then initialised by its own init with RNG seeded at ``seed``: for transformers
    models ``initialize_weights`` (constructors draw random numbers first, which a meta build cannot replay), for
    the plain model its construction itself."""
    if family.startswith("plain"):
        torch.manual_seed(seed)
        return _build(family)
    model = _build(family)
    for tensor_or_module in (*model.modules(), *model.parameters(), *model.buffers()):
        tensor_or_module.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    model.initialize_weights()
    return model


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids)
    return (out if isinstance(out, torch.Tensor) else out.logits).detach()


def _meta_init_matches_eager(families: list[str]) -> dict:
    return {(family, name): result for family in families
            for name, result in _meta_init_of(family).items()}


def _meta_init_of(family: str) -> dict:
    import hf_zeropp

    reference = _eager_reference(family, seed=7)
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    expected_logits = _logits(reference, ids)
    results = {}
    for name, options in CONFIGS.items():
        torch.manual_seed(7)
        model = _build_empty(family)
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**options))
        got = full_parameters(model)
        buffers_equal = all(torch.equal(b, dict(reference.named_buffers())[n]) for n, b in model.named_buffers())
        with torch.no_grad():
            logits = _logits(model, ids)
        results[name] = {
            "names_equal": sorted(got) == sorted(expected),
            "max_difference": max(float((got[n] - expected[n]).abs().max()) for n in expected),
            "buffers_equal": buffers_equal,
            "logits_difference": float((logits - expected_logits).abs().max()),
            "tied": family != "gpt2_tied" or model.lm_head.weight is model.transformer.wte.weight,
        }
    return results


def test_a_meta_model_is_initialised_shard_by_shard_as_its_own_init_does_in_full():
    """Stages 0-3 and ZeRO++, GPT-2 (tied embeddings, scaled residual init from the block's modules), Llama
    (rotary buffers set by the init), a plain torch model, and one built with accelerate's init_empty_weights (its
    buffers stay real and keep their values): the shards equal the eager model's init with the same seed, bit for
    bit."""
    families = ["gpt2_tied", "llama", "plain", "plain_real_buffers"]
    for rank_result in run_distributed(_meta_init_matches_eager, 4, families, node_size=2):
        assert len(rank_result) == len(families) * len(CONFIGS)
        for key, result in rank_result.items():
            assert result["names_equal"] and result["buffers_equal"] and result["tied"], (key, result)
            assert result["max_difference"] == 0.0, (key, result)
            limit = 0.1 if key[1] == "zeropp" else 1e-5  # qwZ gathers INT8 weights in forward
            assert result["logits_difference"] < limit, (key, result)


def _save_pretrained_models(directory) -> dict[str, str]:
    from transformers import GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(3)
    paths = {}
    for family, model in {"gpt2_tied": GPT2LMHeadModel(_gpt2_config(tie=True)),
                          "llama": LlamaForCausalLM(_llama_config())}.items():
        paths[family] = str(directory / family)
        model.save_pretrained(paths[family])
    return paths


def _loaded_on_rank0_only(paths: dict[str, str]) -> dict:
    return {"loaded": _loaded_logits(paths), "frozen": _frozen_int8_from_loaded_weights(paths["gpt2_tied"])}


def _loaded_logits(paths: dict[str, str]) -> dict:
    from transformers import AutoModelForCausalLM

    import hf_zeropp

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    results = {}
    for family, path in paths.items():
        plain = AutoModelForCausalLM.from_pretrained(path)
        expected_logits = _logits(plain, ids)
        for name in ("zero3", "zeropp"):
            model = hf_zeropp.from_pretrained(AutoModelForCausalLM, path)
            on_meta = all(p.is_meta for p in model.parameters())
            hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(**CONFIGS[name]))
            got = full_parameters(model)
            with torch.no_grad():
                logits = _logits(model, ids)
            results[(family, name)] = {
                "on_meta_before": on_meta,
                "max_difference": max(float((got[n] - p.detach()).abs().max()) for n, p in plain.named_parameters()),
                "buffers_equal": all(torch.equal(b, dict(plain.named_buffers())[n])
                                     for n, b in model.named_buffers()),
                "logits_difference": float((logits - expected_logits).abs().max()),
            }
    return results


def test_a_model_loaded_on_rank_0_alone_reaches_every_rank_and_its_frozen_weights_are_quantized_from_it(tmp_path):
    """zero3 and ZeRO++: every rank's shards are the checkpoint's tensors and the logits those of plain
    transformers. LoRA on such a model with quantized_nontrainable_weights: every frozen matrix is stored INT8
    within half a quantization step of the loaded value on every rank — never quantized from the other ranks'
    uninitialised memory."""
    paths = _save_pretrained_models(tmp_path)
    for rank, rank_result in enumerate(run_distributed(_loaded_on_rank0_only, 4, paths, node_size=2)):
        for key, result in rank_result["loaded"].items():
            assert result["on_meta_before"], (key, result)
            assert result["max_difference"] == 0.0 and result["buffers_equal"], (key, result)
            limit = 0.1 if key[1] == "zeropp" else 1e-6
            assert result["logits_difference"] < limit, (key, result)
        frozen = rank_result["frozen"]
        assert frozen["stores"] >= 6, frozen
        assert frozen["worst_error_over_bound"] <= 1.0 + 1e-3, frozen


def _frozen_int8_from_loaded_weights(path: str) -> dict:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    import hf_zeropp
    from hf_zeropp.engine.frozen import frozen_stores

    plain = AutoModelForCausalLM.from_pretrained(path)
    expected = {name: p.detach() for name, p in plain.named_parameters()}
    torch.manual_seed(5)
    model = get_peft_model(hf_zeropp.from_pretrained(AutoModelForCausalLM, path),
                           LoraConfig(r=4, target_modules=["c_attn", "c_fc"], lora_dropout=0.0))
    config = hf_zeropp.ZeroPPConfig(**CONFIGS["zeropp"], quantized_nontrainable_weights=True)
    hf_zeropp.shard_model(model, config)
    worst = 0.0
    stores = frozen_stores(model)
    for name, store in stores.items():
        weight = expected[name.replace("base_model.model.", "").replace("base_layer.", "")]
        restored = store.materialize(torch.float32)
        blocks = weight.reshape(-1)
        pad = (-blocks.numel()) % config.block_size
        bound = torch.nn.functional.pad(blocks, (0, pad)).view(-1, config.block_size).abs().amax(1) / 127 / 2
        error = torch.nn.functional.pad((restored - weight).reshape(-1), (0, pad)).view(-1, config.block_size)
        worst = max(worst, float((error.abs().amax(1) / bound.clamp_min(1e-12)).max()))
    return {"stores": len(stores), "worst_error_over_bound": worst}


def _refusals() -> dict:
    import hf_zeropp

    messages = {}
    with torch.device("meta"):
        model = _build("gpt2_tied")
    model.requires_grad_(False)
    try:
        hf_zeropp.shard_model(model, hf_zeropp.ZeroPPConfig(stage=3, quantized_nontrainable_weights=True))
    except ValueError as error:
        messages["frozen_meta"] = str(error)
    torch.manual_seed(0)
    if dist.get_rank() == 1:
        model = _build("gpt2_tied")
    else:
        with torch.device("meta"):
            model = _build("gpt2_tied")
    try:
        hf_zeropp.shard_model(model, "zero3")
    except ValueError as error:
        messages["mixed"] = str(error)
    return messages


def test_placements_that_cannot_work_fail_on_every_rank_with_the_fix():
    for messages in run_distributed(_refusals, 2):
        assert "built on the meta device on every rank" in messages["frozen_meta"], messages
        assert "rank 0: meta, rank 1: real" in messages["mixed"], messages
        assert "hf_zeropp.from_pretrained" in messages["mixed"], messages


def _trainer_losses(path: str, workdir: str) -> dict:
    """The same 4 Trainer steps: stock (DDP, the checkpoint loaded on every rank) and ZeroPPTrainer with the model
    loaded on rank 0 only, passed in or built by model_init."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_zeropp

    starts = torch.randint(0, VOCAB, (32,), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": ids, "labels": ids} for ids in ((s + torch.arange(16)) % VOCAB for s in starts)]
    options = dict(max_steps=4, per_device_train_batch_size=2, learning_rate=1e-2, adam_epsilon=1e-6,
                   logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0)

    def losses(trainer) -> list[float]:
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    def zeropp_args(name: str):
        return hf_zeropp.ZeroPPTrainingArguments(output_dir=f"{workdir}/{name}", zeropp="zero3", **options)

    return {
        "stock": losses(Trainer(model=AutoModelForCausalLM.from_pretrained(path), train_dataset=data,
                                args=TrainingArguments(output_dir=f"{workdir}/stock", **options))),
        "model": losses(hf_zeropp.ZeroPPTrainer(model=hf_zeropp.from_pretrained(AutoModelForCausalLM, path),
                                                train_dataset=data, args=zeropp_args("model"))),
        "model_init": losses(hf_zeropp.ZeroPPTrainer(
            model_init=lambda: hf_zeropp.from_pretrained(AutoModelForCausalLM, path), train_dataset=data,
            args=zeropp_args("model_init"))),
    }


def test_the_trainer_trains_a_model_loaded_on_rank_0_alone_as_stock_trains_the_full_one(tmp_path):
    path = _save_pretrained_models(tmp_path)["llama"]
    for result in run_distributed(_trainer_losses, 4, path, str(tmp_path), node_size=2):
        assert len(result["stock"]) == 4, result
        for name in ("model", "model_init"):
            assert result[name] == pytest.approx(result["stock"], rel=1e-6), (name, result)


def _dpo_losses(path: str, workdir: str) -> dict:
    """TRL DPO (beta > 0: a reference model) for 3 steps: stock with the checkpoint's path, and behind the mixin
    with the policy and the reference model both loaded on rank 0 only."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    import hf_zeropp

    data = Dataset.from_dict({"prompt": [f"x{i} =" for i in range(32)], "chosen": [f" {i * 7}" for i in range(32)],
                              "rejected": [" none" for _ in range(32)]})
    options = dict(per_device_train_batch_size=2, learning_rate=1e-3, adam_epsilon=1e-6, bf16=False, max_steps=3,
                   max_length=32, beta=0.1, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                   seed=0)
    tokenizer = AutoTokenizer.from_pretrained(path)
    stock = DPOTrainer(model=path, args=DPOConfig(output_dir=f"{workdir}/stock", **options), train_dataset=data,
                       processing_class=tokenizer)
    stock.train()
    trainer_class = type("ZeroPPDPOTrainer", (hf_zeropp.ZeroPPTrainerMixin, DPOTrainer), {})
    ours = trainer_class(model=hf_zeropp.from_pretrained(AutoModelForCausalLM, path),
                         ref_model=hf_zeropp.from_pretrained(AutoModelForCausalLM, path),
                         args=hf_zeropp.with_zeropp_field(DPOConfig)(output_dir=f"{workdir}/zero3", zeropp="zero3",
                                                                     **options),
                         train_dataset=data, processing_class=tokenizer)
    ours.train()

    def losses(trainer) -> list[float]:
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    return {"stock": losses(stock), "zero3": losses(ours), "reference_sharded": hasattr(ours.ref_model, "_zeropp")}


def test_a_trl_reference_model_loaded_on_rank_0_alone_is_sharded_and_dpo_equals_stock(tmp_path):
    pytest.importorskip("trl", reason="TRL is optional (pip install hf_zeropp[rlhf])")
    path = str(tmp_path / "base")
    save_tiny_gpt2_with_tokenizer(path)
    for result in run_distributed(_dpo_losses, 4, path, str(tmp_path), node_size=2):
        assert result["reference_sharded"], result
        assert len(result["stock"]) == 3 and result["zero3"] == pytest.approx(result["stock"], rel=1e-6), result
