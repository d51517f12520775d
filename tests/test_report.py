"""scripts/report_convergence.py on recorded metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _write_run(folder: Path, recipe: str, losses: list[float]) -> None:
    folder.mkdir(parents=True)
    lines = [{"recipe": recipe, "step": 10 * (i + 1), "loss": loss + 0.1} for i, loss in enumerate(losses)]
    lines += [{"recipe": recipe, "step": 10 * (i + 1), "eval_loss": loss} for i, loss in enumerate(losses)]
    lines.append({"recipe": recipe, "step": 10 * len(losses), "train_runtime": 12.5})
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_report_table_and_plot(tmp_path):
    _write_run(tmp_path / "zero3", "zero3", [3.0, 2.5, 2.0])
    _write_run(tmp_path / "zeropp", "zeropp", [3.1, 2.6, 2.04])
    _write_run(tmp_path / "zeropp_nonblocked", "zeropp_nonblocked", [3.5, 3.4, 3.3])
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "report_convergence.py"), str(tmp_path),
                             "--baseline", "zero3", "--out", str(tmp_path / "report")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    table = (tmp_path / "report" / "table.md").read_text().splitlines()
    assert table[2].startswith("| zero3 | 2.0000 | +0.00 % | 2.1218 (+0.00 %) | 12 s |")
    assert "| zeropp | 2.0400 | +2.00 % | 2.1656 (+2.06 %) |" in "\n".join(table)
    assert "| zeropp_nonblocked | 3.3000 | +65.00 % | diverged |" in "\n".join(table)
    png = (tmp_path / "report" / "validation_loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_report_without_baseline_fails_clearly(tmp_path):
    _write_run(tmp_path / "zeropp", "zeropp", [3.0])
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "report_convergence.py"), str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "baseline run 'zero3' not found" in result.stderr
