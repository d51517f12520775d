"""The tables: means over the measured steps per candidate and class, the horizon, surprise and delivery tables, and
the markdown report."""

from __future__ import annotations


import torch


from .candidates import CLASSES, DELIVERY_COLUMNS, RULE_BITS, RULE_HADAMARD, SURPRISE, WEIGHT_CANDIDATES, WIDTH_RULES


def summarize(result: dict) -> dict:
    """Means (and min/max) over the measured steps of each metric, per candidate and class."""
    def table(kind: str, names: list[str]) -> list[dict] | None:
        measured = [step[kind] for step in result["steps"].values() if step[kind] is not None]
        if not measured:
            return None
        stacked = torch.tensor(measured, dtype=torch.float64)
        rows = []
        for c, name in enumerate(names):
            row = {"name": name}
            for k, cls in enumerate(CLASSES):
                row[cls] = {"relative_error": stacked[:, c, k, 0].mean().item(),
                            "relative_error_range": [stacked[:, c, k, 0].min().item(),
                                                     stacked[:, c, k, 0].max().item()],
                            "cosine": stacked[:, c, k, 1].mean().item()}
            rows.append(row)
        return rows

    names = result["gradient_candidates"]
    gradients = table("gradients", names)
    scaled = table("adam_scaled_gradients", names)
    full = max(w["horizon"] for w in result["windows"])

    def summed(horizon: int, adam: bool) -> torch.Tensor | None:
        """Mean over the windows of the error summed over ``horizon`` steps, per candidate (all classes)."""
        errors = [w["errors"] for w in result["windows"] if w["horizon"] == horizon and (w["scaled"] or not adam)]
        return torch.tensor(errors, dtype=torch.float64)[:, :, -1, int(adam)].mean(0) if errors else None
    by_horizon = {h: (summed(h, False), summed(h, True)) for h in sorted({w["horizon"] for w in result["windows"]})}
    for c, row in enumerate(gradients):
        row["window_sum_error"] = by_horizon[full][0][c].item()
        row["summed_over_steps"] = {h: {"plain": plain[c].item(), "adam_normalized": None if adam is None
                                        else adam[c].item()} for h, (plain, adam) in by_horizon.items()}
        row["inter_node_mb_per_step"] = result["gradient_inter_node_mb"][c]
        if scaled is not None:
            row["adam_scaled"] = {cls: scaled[c][cls] for cls in CLASSES}
            adam = by_horizon[full][1]
            row["adam_scaled_window_sum_error"] = None if adam is None else adam[c].item()
    weights = table("weights", list(WEIGHT_CANDIDATES))
    for c, row in enumerate(weights):
        row["inter_node_mb_per_step"] = result["weight_inter_node_mb"][c]
    surprise = [step["surprise"] for step in result["steps"].values() if step["surprise"] is not None]
    if surprise:
        totals = torch.tensor(surprise, dtype=torch.float64).sum(0)
        energy, count = totals[-2], totals[-1]
        for c, row in enumerate(gradients):
            error = totals[c]
            elsewhere = (error[0] - error[1]) / (energy[0] - energy[1]).clamp_min(1e-300)
            row["error_on_surprised"] = {"share_of_squared_error": (error[1] / error[0].clamp_min(1e-300)).item(),
                                         "relative_error_elsewhere": elsewhere.sqrt().item()}
    delivery = [step["delivery"] for step in result["steps"].values() if step["delivery"] is not None]
    deliveries = None
    if delivery:  # recorded at the same steps as the surprise sums, which hold the driving option's whole error
        driving_error = max(totals[names.index(result["drive"])][0].item(), 1e-300)
        deliveries = {}
        for group, (elements, unseen, *shares, starved_error) in zip(
                ("surprised", "others"), torch.tensor(delivery, dtype=torch.float64).sum(0).tolist()):
            seen = max(elements - unseen, 1e-300)
            deliveries[group] = {"elements": elements,
                                 "share_without_earlier_gradient": unseen / max(elements, 1e-300),
                                 **{column: value / seen for column, value in zip(DELIVERY_COLUMNS[2:-1], shares)},
                                 DELIVERY_COLUMNS[-1]: starved_error / driving_error}
    rules = table("width_rules", list(WIDTH_RULES))
    scaled_rules = table("adam_scaled_width_rules", list(WIDTH_RULES))
    for c, row in enumerate(rules):
        if scaled_rules is not None:
            row["adam_scaled"] = {cls: scaled_rules[c][cls] for cls in CLASSES}
    return {"model": result["model"], "drive": result["drive"], "validation_loss": result["validation_loss"],
            "last_step": result["last_step"], "gradients": gradients, "weights": weights, "width_rules": rules,
            "surprised": None if not surprise else {"share_of_elements": (count[1] / count[0]).item(),
                                                    "share_of_normalized_energy": (energy[1] / energy[0]).item()},
            "deliveries": deliveries,
            "measured_steps": sorted(int(s) for s in result["steps"])}


def _cell(entry: dict) -> str:
    return f"{entry['relative_error']:.4f} ({entry['cosine']:.5f})"


def horizon_table(topology: str, summary: dict) -> list[str]:
    """The error of the gradients summed over the first h steps of each window, as h grows: an error that changes
    from step to step shrinks against the summed gradient, one that repeats (a bias) does not."""
    rows = summary["gradients"]
    spans = list(rows[0]["summed_over_steps"])
    if len(spans) < 2:
        return []
    lines = ["", f"### {topology}: the error of the gradients summed over h consecutive steps (all classes; "
             "plain, then Adam-normalized), mean over the windows", "",
             "| configuration | " + " | ".join(f"h = {h}" for h in spans) + " | "
             + " | ".join(f"Adam h = {h}" for h in spans) + f" | ZeRO++'s Adam error / this at h = {spans[-1]} |",
             "|---|" + "---:|" * (2 * len(spans) + 1)]
    reference = rows[0]["summed_over_steps"][spans[-1]]["adam_normalized"]
    for row in rows:
        cells = row["summed_over_steps"]
        adam = [cells[h]["adam_normalized"] for h in spans]
        lines.append(f"| {row['name']} | " + " | ".join(f"{cells[h]['plain']:.4f}" for h in spans) + " | "
                     + " | ".join("—" if a is None else f"{a:.4f}" for a in adam) + " | "
                     + ("—" if None in (reference, adam[-1]) else f"{reference / max(adam[-1], 1e-30):.2f}x") + " |")
    return lines


def surprise_table(topology: str, summary: dict) -> list[str]:
    """How much of each row's Adam-normalized error lies on the elements whose exact gradient surprises the run's
    second moment (AdamNormalizer.surprised), and the error on the rest."""
    if summary["surprised"] is None:
        return []
    share = summary["surprised"]
    lines = ["", f"### {topology}: where the Adam-normalized error lies: elements whose exact gradient exceeds "
             f"{SURPRISE:g}x the root of the run's second moment before the step "
             f"({share['share_of_elements']:.3%} of the elements, {share['share_of_normalized_energy']:.1%} of the "
             "normalized exact gradient's squared norm)", "",
             "| configuration | share of its squared error on those elements | relative error on the other elements |",
             "|---|---:|---:|"]
    for row in summary["gradients"]:
        cell = row["error_on_surprised"]
        lines.append(f"| {row['name']} | {cell['share_of_squared_error']:.1%} | "
                     f"{cell['relative_error_elsewhere']:.4f} |")
    return lines


def delivery_table(topology: str, summary: dict) -> list[str]:
    """Whether the driving option had starved the surprising elements before the step (Deliveries)."""
    deliveries = summary["deliveries"]
    if deliveries is None:
        return []
    lines = ["", f"### {topology}: what {summary['drive']!r} had delivered before the step (moving averages with "
             "Adam's beta2; the energy columns and the zero share over the elements that had an exact gradient "
             "before)", "",
             "| elements | count (all steps) | no exact gradient before | " + " | ".join(DELIVERY_COLUMNS[2:]) + " |",
             "|---|" + "---:|" * (len(DELIVERY_COLUMNS))]
    for group, cells in deliveries.items():
        lines.append(f"| {group} | {cells['elements']:,.0f} | {cells['share_without_earlier_gradient']:.1%} | "
                     + " | ".join(f"{cells[column]:.1%}" for column in DELIVERY_COLUMNS[2:]) + " |")
    return lines


def markdown(topology: str, summary: dict) -> str:
    steps = summary["measured_steps"]
    reference = summary["gradients"][0]["all"]["relative_error"]
    trained_on = ("the exact gradients (the ZeRO-3 baseline)" if summary["drive"] is None
                  else f"the gradients of {summary['drive']!r} (its own trajectory; forward weights exact)")
    lines = [f"### {topology}: gradients (qgZ result vs the exact reduce-scatter), {len(steps)} steps {steps}", "",
             f"model: {summary['model']}; trained on {trained_on}; validation loss after "
             f"{summary['last_step']} steps: {summary['validation_loss']:.4f}", "",
             "relative L2 error (cosine) per parameter class, mean over the measured steps; window sum = error of "
             "the gradients summed over each window", "",
             "| configuration | cross-node MB/step (rank 0) | matrices | embeddings | 1-D | all | "
             "ZeRO++'s error / this | window sum |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary["gradients"]:
        lines.append(f"| {row['name']} | {row['inter_node_mb_per_step']:.3f} | "
                     + " | ".join(_cell(row[cls]) for cls in CLASSES)
                     + f" | {reference / max(row['all']['relative_error'], 1e-30):.2f}x | "
                       f"{row['window_sum_error']:.4f} |")
    if "adam_scaled" in summary["gradients"][0]:
        reference = summary["gradients"][0]["adam_scaled"]["all"]["relative_error"]
        lines += ["", f"### {topology}: gradients as Adam normalizes them (g / (sqrt(v_hat(g)) + eps), the "
                  "step of the run that consumes them): the error of the update direction", "",
                  "| configuration | matrices | embeddings | 1-D | all | ZeRO++'s error / this | window sum |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for row in summary["gradients"]:
            window = row["adam_scaled_window_sum_error"]
            lines.append(f"| {row['name']} | " + " | ".join(_cell(row["adam_scaled"][cls]) for cls in CLASSES)
                         + f" | {reference / max(row['adam_scaled']['all']['relative_error'], 1e-30):.2f}x | "
                         + ("—" if window is None else f"{window:.4f}") + " |")
    lines += horizon_table(topology, summary)
    lines += surprise_table(topology, summary)
    lines += delivery_table(topology, summary)
    rule_classes = ("matrices", "embeddings", "all")
    fixed = summary["width_rules"][0]
    scaled = "adam_scaled" in fixed
    lines += ["", f"### {topology}: per-block widths on the inter-node hop: one quantization of the exact shard "
              f"(Hadamard {RULE_HADAMARD}, 1-D left out, {RULE_BITS}-bit budget)", "",
              "relative L2 error per class"
              + (", then the same of the Adam-normalized gradients" if scaled else ""), "",
              "| width rule | " + " | ".join(rule_classes) + " | fixed's error / this |"
              + (" Adam: " + " | ".join(rule_classes) + " | fixed's error / this |" if scaled else ""),
              "|---|" + "---:|" * (8 if scaled else 4)]

    def ratio(row: dict, reference: dict) -> str:
        return f"{reference['all']['relative_error'] / max(row['all']['relative_error'], 1e-30):.2f}x"
    for row in summary["width_rules"]:
        line = (f"| {row['name']} | " + " | ".join(f"{row[c]['relative_error']:.4f}" for c in rule_classes)
                + f" | {ratio(row, fixed)} |")
        if scaled:
            line += (" " + " | ".join(f"{row['adam_scaled'][c]['relative_error']:.4f}" for c in rule_classes)
                     + f" | {ratio(row['adam_scaled'], fixed['adam_scaled'])} |")
        lines.append(line)
    lines += ["", f"### {topology}: weights (qwZ forward gather vs the exact one)", "",
              "| configuration | cross-node MB/step (rank 0) | matrices | embeddings | 1-D | all |",
              "|---|---:|---:|---:|---:|---:|"]
    for row in summary["weights"]:
        lines.append(f"| {row['name']} | {row['inter_node_mb_per_step']:.3f} | "
                     + " | ".join(_cell(row[cls]) for cls in CLASSES) + " |")
    return "\n".join(lines) + "\n"


