"""``python -m scripts.model_families.quantized_weights``: is a family's ZeRO++ gradient error quantization or wiring?

Runs the family under qwZ alone (``zeropp-qwz``) on 2 emulated nodes of 2 ranks, as the sweep does, and records the
weights each module computes with in the forward (what qwZ's all-gather dequantized), on every rank. Then, on one
process, stock's gradient at stock's weights and at those gathered weights. If qwZ's gradient equals stock's at the
gathered weights to fp32 rounding, qwZ's whole difference from stock is the INT8 rounding of the weights.

For a mixture of experts whose routers return (dispatch mask, probability, logits), as Switch Transformers' do, it
also compares the routing token by token (stock's weights against the gathered ones, and against them with only the
routers' weights gathered or only theirs stock's), and the gradient at the gathered weights with stock's routing
forced. To show the error follows the rounding, it also takes stock's gradient at stock's weights plus a fraction of
qwZ's rounding.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from hf_zeropp.testing.spawn import run_distributed

from .catalog import batch, build, loss, tiny_config
from .ranks import sharded_step

WORLD, NODE_SIZE = 4, 2


def _capture_ranks(head: str, family: str) -> dict | None:
    """Every rank's qwZ step; rank 0 returns qwZ's gradients and the weights used in the first forward, merged over
    the ranks (an expert one rank's tokens do not reach is recorded where they do)."""
    import transformers
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    transformers.logging.set_verbosity_error()
    captured: dict[str, torch.Tensor] = {}
    forward_done = []

    def observe(model: torch.nn.Module) -> None:
        for prefix, module in model.named_modules():
            def record(module, args, prefix=prefix):
                for name, param in module.named_parameters(recurse=False):
                    key = f"{prefix}.{name}" if prefix else name
                    if not forward_done and key not in captured and not hasattr(param, "full_tensor"):
                        captured[key] = param.detach().clone()
            module.register_forward_pre_hook(record)

    handle = register_optimizer_step_pre_hook(lambda *args: forward_done.append(True))
    try:
        ours = sharded_step(head, family, tiny_config(head, family), "zeropp-qwz", NODE_SIZE, observe)
    finally:
        handle.remove()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, captured)
    if dist.get_rank() != 0:
        return None
    merged: dict[str, torch.Tensor] = {}
    for weights in everyone:
        for key, value in weights.items():
            if key in merged and not torch.equal(merged[key], value):
                raise AssertionError(f"ranks gathered different values of {key}")
            merged.setdefault(key, value)
    return {"grads": ours["grads"], "loss": ours["loss"], "weights": merged}


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Router")]


def _stock_at(head: str, family: str, weights: dict, forced: list | None = None) -> dict:
    """One process at ``weights`` (stock's where absent): the mean loss of the ranks' micro-batches, its gradients,
    and each router's logits per rank; ``forced``: each token goes to the expert it went to in that run."""
    config = tiny_config(head, family)
    model = build(head, family, config)
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in weights:
                param.copy_(weights[name])
    logits: list[list[torch.Tensor]] = []

    def route(router, args, out):
        logits[-1].append(out[2].detach())
        if forced is None:
            return None
        choice = forced[len(logits) - 1][len(logits[-1]) - 1].argmax(-1)
        mask = torch.nn.functional.one_hot(choice, num_classes=out[0].shape[-1])
        mask = mask * (torch.cumsum(mask, dim=-2) <= router.expert_capacity)
        probability = torch.softmax(out[2].float(), -1).gather(-1, choice.unsqueeze(-1)).to(out[1].dtype)
        return mask, probability, out[2]

    for router in _routers(model):
        router.register_forward_hook(route)
    losses = []
    for rank in range(WORLD):
        logits.append([])
        losses.append(loss(model, batch(head, config, rank), rank))
    mean = torch.stack(losses).mean()
    mean.backward()
    grads = {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": float(mean), "grads": grads, "logits": logits, "routers": len(_routers(model))}


def _errors(grads: dict, reference: dict) -> tuple[float, float, str]:
    """Whole-gradient relative error, and the worst parameter's (as the sweep normalises it) with its name."""
    names = [n for n in reference if n in grads]
    total = float(torch.cat([reference[n].reshape(-1) for n in names]).norm())
    whole = float(torch.cat([(grads[n] - reference[n]).reshape(-1) for n in names]).norm()) / total
    each = {n: float((grads[n] - reference[n]).norm()) / max(float(reference[n].norm()), 0.01 * total)
            for n in names}
    worst = max(each, key=each.get)
    return whole, each[worst], worst


def _moved(logits: list, reference: list) -> tuple[int, int]:
    moved = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for ra, rb in zip(logits, reference) for a, b in zip(ra, rb))
    tokens = sum(b.argmax(-1).numel() for rb in reference for b in rb)
    return moved, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.model_families.quantized_weights", description=__doc__)
    parser.add_argument("--head", required=True)
    parser.add_argument("--family", required=True)
    args = parser.parse_args(argv)
    head, family = args.head, args.family
    qwz = run_distributed(_capture_ranks, WORLD, head, family, node_size=NODE_SIZE, timeout=600)[0]
    stock = _stock_at(head, family, {})
    gathered = _stock_at(head, family, qwz["weights"])
    initial = dict(build(head, family, tiny_config(head, family)).named_parameters(remove_duplicate=False))
    rounding = max(float((w - initial[n]).norm() / max(float(initial[n].norm()), 1e-12))
                   for n, w in qwz["weights"].items())
    print(f"{head}/{family}: qwZ (INT8 weights) on {WORLD // NODE_SIZE} x {NODE_SIZE} ranks; the weights' largest "
          f"relative rounding {rounding:.1e}")
    print(f"loss: stock {stock['loss']:.6f}, stock at qwZ's weights {gathered['loss']:.6f}, qwZ {qwz['loss']:.6f}")
    for label, grads, reference in (("qwZ against stock", qwz["grads"], stock["grads"]),
                                    ("stock at qwZ's weights against stock", gathered["grads"], stock["grads"]),
                                    ("qwZ against stock at qwZ's weights", qwz["grads"], gathered["grads"])):
        whole, worst, name = _errors(grads, reference)
        print(f"gradient, {label}: whole {whole:.2e}, worst parameter {worst:.2e} ({name})")
    for fraction in (1 / 64, 1 / 8, 1 / 2):  # a wiring fault would not shrink with the rounding
        scaled = {n: initial[n].detach() + fraction * (w - initial[n].detach()) for n, w in qwz["weights"].items()}
        whole = _errors(_stock_at(head, family, scaled)["grads"], stock["grads"])[0]
        print(f"gradient at stock's weights + {fraction:g} x qwZ's rounding, against stock: whole {whole:.2e}")
    if stock["routers"]:
        only = {"only the routers' weights qwZ's": {n: w for n, w in qwz["weights"].items() if ".router." in n},
                "all but the routers' weights qwZ's": {n: w for n, w in qwz["weights"].items()
                                                       if ".router." not in n}}
        for label, run in (("qwZ's weights", gathered), *((k, _stock_at(head, family, w)) for k, w in only.items())):
            moved, tokens = _moved(run["logits"], stock["logits"])
            print(f"routing, {label}: {moved} of {tokens} tokens sent to another expert than stock's "
                  f"({stock['routers']} routers, {WORLD} micro-batches); gradient against stock: whole "
                  f"{_errors(run['grads'], stock['grads'])[0]:.2e}")
        forced = _stock_at(head, family, qwz["weights"], forced=stock["logits"])
        whole, worst, name = _errors(forced["grads"], stock["grads"])
        print(f"gradient at qwZ's weights with stock's routing forced: whole {whole:.2e}, worst parameter "
              f"{worst:.2e} ({name})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
