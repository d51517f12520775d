"""Print the conformance table: each public pattern under stock Accelerate / Trainer / TRL and under hf_zeropp
(zero3, ZeRO++ and hybrid-q), side by side, from the patterns the conformance tests run (hf_zeropp.testing.conformance).

    .venv/bin/python scripts/conformance_table.py        # ~8 min on 2 CPU cores: 4 gloo ranks as 2 nodes x 2

Each cell is the pattern's last training loss (or what the pattern checks), ``fails`` if the run raised.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from hf_zeropp.testing import conformance
from hf_zeropp.testing.spawn import run_distributed
from hf_zeropp.testing.tiny_models import save_tiny_gpt2_with_tokenizer

MODES = ("stock", "zero3", "zeropp", "hybrid-q")


def _launch(worker, modes, *args, world: int = conformance.WORLD) -> dict[str, dict | str]:
    results: dict[str, dict | str] = {}
    for mode in modes:
        try:
            results[mode] = run_distributed(worker, world, mode, *args, node_size=min(world, conformance.NODE_SIZE))[0]
        except AssertionError as error:
            results[mode] = f"fails ({str(error).strip().splitlines()[-1][:60]})"
    return results


def _cell(result, read) -> str:
    if isinstance(result, str):
        return result
    try:
        return read(result)
    except (KeyError, TypeError, ValueError) as error:
        return f"fails ({error})"


def main() -> None:
    workdir = Path(tempfile.mkdtemp(prefix="conformance_"))
    accelerate = _launch(conformance.accelerate_patterns, MODES, str(workdir / "accelerate"))
    trainer = _launch(conformance.trainer_patterns, MODES, str(workdir / "trainer"))
    resumed = _launch(conformance.trainer_resume_on_two_ranks, MODES, str(workdir / "trainer"), world=2)
    save_tiny_gpt2_with_tokenizer(workdir / "trl" / "base")
    trl = _launch(conformance.trl_patterns, (*MODES, "zeropp-lora"), str(workdir / "trl"))

    def last(values) -> str:
        return f"{values[-1]:.6f}"

    def logits_match(result, name) -> str:
        reference = result["reloaded_logits"]["save_model"]
        return "loads, logits = save_model's" if torch.equal(result["reloaded_logits"][name], reference) else "differs"

    rows = [
        ("one-call prepare + accumulation + clip: last loss", accelerate, lambda r: last(r["one_call"]["loss"])),
        ("clip_grad_norm_: last norm", accelerate, lambda r: last(r["one_call"]["grad_norm"])),
        ("gather_for_metrics (11 samples, 4 ranks)", accelerate,
         lambda r: f"{len(r['one_call']['evaluated_samples'])} samples"),
        ("split prepare (model, then optimizer): last loss", accelerate, lambda r: last(r["split_prepare"]["loss"])),
        ("dynamo settings, regional (hf_zeropp: per FSDP unit) + accumulation: last loss", accelerate,
         lambda r: last(r["compiled"]["loss"])),
        ("FSDP2 order + save_state/load_state: resumed = uninterrupted", accelerate,
         lambda r: "bit-exact" if r["fsdp2_order"]["resumed_loss"] == r["fsdp2_order"]["uninterrupted_loss"]
         else f"differs {r['fsdp2_order']['resumed_loss']}"),
        ("get_state_dict: lm_head.weight norm", accelerate,
         lambda r: f"{float(r['one_call']['state_dict']['lm_head.weight'].norm()):.6f}"),
        ("unwrap_model().save_pretrained(), no state_dict", accelerate, lambda r: logits_match(r["one_call"],
                                                                                                "no_state_dict")),
        ("unwrap_model().save_pretrained(state_dict=get_state_dict)", accelerate,
         lambda r: logits_match(r["one_call"], "with_state_dict")),
        ("load_state_dict(full tensors): loss of the initial weights", accelerate,
         lambda r: f"{r['one_call']['loss_after_loading_initial_weights']:.6f}"),
        ("Trainer: last loss", trainer, lambda r: last(r["loss"])),
        ("Trainer load_best_model_at_end (greater_is_better): best / its eval = final eval", trainer,
         lambda r: f"{r['best_checkpoint']}, {r['eval_loss'][int(r['best_checkpoint'].split('-')[1])]:.6f} = "
                   f"{r['final_eval_loss']:.6f}"),
        ("Trainer save_model: reloaded = best checkpoint", trainer,
         lambda r: "equal" if torch.equal(r["reloaded_logits"], r["best_checkpoint_logits"]) else "differs"),
        ("Trainer resume_from_checkpoint 4 -> 2 ranks (hf_zeropp: --torch_compile): last loss", resumed,
         lambda r: last(r["loss"])),
        *[(f"TRL {kind.upper()} behind the mixin: last loss", trl, lambda r, kind=kind: last(r[kind]["loss"]))
          for kind in ("sft", "dpo")],
        ("TRL GRPO (beta 0.1) behind the mixin: last mean reward", trl, lambda r: last(r["grpo"]["reward"])),
        *[(f"TRL {kind.upper()} reference model: bytes per rank", trl,
           lambda r, kind=kind: f"{r[kind]['reference_bytes']:,}") for kind in ("dpo", "grpo")],
    ]
    print("| pattern | " + " | ".join("stock" if m == "stock" else f"hf_zeropp {m}" for m in MODES)
          + " | hf_zeropp zeropp-lora |")
    print("|---" * (len(MODES) + 2) + "|")
    for name, results, read in rows:
        cells = [_cell(results[mode], read) for mode in MODES]
        extra = _cell(results["zeropp-lora"], read) if "zeropp-lora" in results else ""
        print(f"| {name} | " + " | ".join(cells) + f" | {extra} |")


if __name__ == "__main__":
    main()
