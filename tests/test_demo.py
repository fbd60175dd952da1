"""The offline demo: both scripts on generated data, and one report holding everything they computed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_demo_report_holds_all_it_ran(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "tools.demo", "--out", str(out), "--per-class", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[:3000]  # its first output was torch.jit.save's deprecation
    assert (out / "color9.pt2").is_file() and not (out / "color9.ts").exists()  # a torch.export program
    report = (out / "report.md").read_text()
    assert "Not run" not in report
    for heading in ("## IN-9 accuracy", "## Backgrounds Challenge", "## Adversarial backgrounds",
                    "## Prediction categories", "## Provenance"):
        assert heading in report, heading
    assert "| `mixed_rand` |" in report and "BG-gap" in report
    page = (out / "report.html").read_text()
    for heading in ("IN-9 accuracy", "Backgrounds Challenge", "Adversarial backgrounds", "Prediction categories"):
        assert f"<h2>{heading}</h2>" in page, heading
    assert "data:image/jpeg;base64," in page and "Not run." not in page
    assert (out / "in9.json").stat().st_mode & 0o077 == (out / "report.md").stat().st_mode & 0o077
