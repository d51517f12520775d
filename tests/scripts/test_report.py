"""scripts/experiments/report_convergence.py on recorded metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from paths import ROOT



def _write_run(folder: Path, recipe: str, losses: list[float], seed: int | None = None) -> None:
    folder.mkdir(parents=True)
    tag = {} if seed is None else {"seed": seed}
    lines = [{"recipe": recipe, **tag, "step": 10 * (i + 1), "loss": loss + 0.1} for i, loss in enumerate(losses)]
    lines += [{"recipe": recipe, **tag, "step": 10 * (i + 1), "eval_loss": loss} for i, loss in enumerate(losses)]
    lines.append({"recipe": recipe, **tag, "step": 10 * len(losses), "train_runtime": 12.5})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def _report(folder: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "scripts.experiments.report_convergence", str(folder), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_report_table_and_plot(tmp_path):
    _write_run(tmp_path / "zero3", "zero3", [3.0, 2.5, 2.0])
    _write_run(tmp_path / "zeropp", "zeropp", [3.1, 2.6, 2.04])
    _write_run(tmp_path / "zeropp_nonblocked", "zeropp_nonblocked", [3.5, 3.4, 3.3])
    result = _report(tmp_path, "--baseline", "zero3", "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "report" / "table.md").read_text().splitlines()
    assert table[2] == "| zero3 | 0 | 2.0000 | +0.00 % | — | — | 2.1218 (+0.00 %) | 12 s |"
    assert "| zeropp | 0 | 2.0400 | +2.00 % | — | — | 2.1656 (+2.06 %) | 12 s |" in table
    assert "| zeropp_nonblocked | 0 | 3.3000 | +65.00 % | — | — | diverged | 12 s |" in table
    png = (tmp_path / "report" / "validation_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    # another study (the second accuracy case): no Table 5 column
    result = _report(tmp_path, "--no-paper", "--out", str(tmp_path / "other"))
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "other" / "table.md").read_text().splitlines()
    assert "paper" not in table[0] and table[1].count("|") == table[2].count("|") == 8
    assert "| zeropp | 0 | 2.0400 | +2.00 % | — | — | 12 s |" in table


def test_report_averages_seeds_and_pairs_each_gap_with_its_own_baseline(tmp_path):
    """Gaps are per seed against the same seed's baseline: +2 % and +4 % average to +3 % (sample std 1.41), not
    the gap of the means; with two seeds the 95 % interval is 3 ± t(0.975, 1) x 1.41 / sqrt(2) = 3 ± 12.71."""
    for seed, (base, other) in enumerate([(2.0, 2.04), (2.5, 2.6)]):
        _write_run(tmp_path / f"seed{seed}" / "zero3", "zero3", [3.0, base], seed=seed)
        _write_run(tmp_path / f"seed{seed}" / "zeropp", "zeropp", [3.0, other])  # seed from the folder name
    _write_run(tmp_path / "seed2" / "zeropp", "zeropp", [3.0, 9.0], seed=2)  # no baseline of seed 2
    _write_run(tmp_path / "seed3" / "zeropp", "zeropp", [3.0], seed=3)
    unfinished = tmp_path / "seed3" / "zeropp" / "metrics.jsonl"
    unfinished.write_text("".join(line + "\n" for line in unfinished.read_text().splitlines()
                                  if "train_runtime" not in line))
    result = _report(tmp_path)
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "report" / "table.md").read_text().splitlines()
    assert table[2] == "| zero3 | 0,1 | 2.2500 ± 0.3536 | +0.00 ± 0.00 % | [+0.00, +0.00] % | +0.00, +0.00 | 2.1218 (+0.00 %) | 12 s |"
    assert table[3] == "| zeropp | 0,1,2 | 4.5467 ± 3.8669 | +3.00 ± 1.41 % | [-9.71, +15.71] % | +2.00, +4.00 | 2.1656 (+2.06 %) | 12 s |"
    assert "skipping" in result.stderr and "seed3" in result.stderr


def test_student_t_quantiles_match_published_tables():
    """Two-sided 95 % critical values (t tables; df=1000 approaches the normal 1.96) and one one-sided 95 %."""
    from scripts.experiments.report_convergence import confidence_interval, student_t_quantile

    for df, expected in [(1, 12.7062), (2, 4.3027), (3, 3.1824), (7, 2.3646), (30, 2.0423), (1000, 1.9623)]:
        assert abs(student_t_quantile(0.975, df) - expected) < 1e-4, df
    assert abs(student_t_quantile(0.95, 4) - 2.1318) < 1e-4
    low, high = confidence_interval([0.1, 0.3, 0.2, 0.4, 0.0, 0.2, 0.3, 0.1])  # mean 0.2, sd 0.1309, n 8
    assert abs(low - (0.2 - 2.3646 * 0.130931 / 8 ** 0.5)) < 1e-4 and abs(high + low - 0.4) < 1e-12


def test_report_refuses_two_runs_of_one_recipe_and_seed(tmp_path):
    _write_run(tmp_path / "a" / "zero3", "zero3", [2.0], seed=0)
    _write_run(tmp_path / "b" / "zero3", "zero3", [2.1], seed=0)
    result = _report(tmp_path)
    assert result.returncode != 0 and "two runs of 'zero3' with seed 0" in result.stderr


def test_report_without_baseline_fails_clearly(tmp_path):
    _write_run(tmp_path / "zeropp", "zeropp", [3.0])
    result = _report(tmp_path)
    assert result.returncode != 0 and "baseline run 'zero3' not found" in result.stderr
