"""The offline demo: both scripts on generated data, and one report holding everything they computed."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.helpers import run_forked
from tools import demo
from tools.data import cache_admin
from tools.data.store import default_cache_dir

pytestmark = pytest.mark.slow  # end to end: the demo's whole run

REPO = Path(__file__).resolve().parents[1]


def test_the_demo_imports_without_a_warning():
    """What `python -m tools.demo` prints while importing (torch's import, and the toolkit's and its libraries'),
    which the in-process run below cannot see: no warning."""
    (done,) = run_forked([["-c", "import tools.demo"]], REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr[:3000]


def test_the_demo_report_holds_all_it_ran(tmp_path, capfd):
    """The demo's main in this process (it runs the scripts as processes, whose output capfd takes too), under the
    warning filters a Python process starts with rather than the suite's."""
    out = tmp_path / "demo"
    cached = cache_admin.survey(default_cache_dir()).size
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # Python's own defaults, as `python -m tools.demo` has them
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.simplefilter("ignore", category)
        warnings.filterwarnings("default", category=DeprecationWarning, module="tools.demo")  # its __main__
        code = demo.main(["--out", str(out), "--per-class", "1"])
    stdout, stderr = capfd.readouterr()
    assert code == 0, stderr[-3000:]
    added = cache_admin.survey(default_cache_dir()).size - cached  # the suite's cache (tests/tree_guard.py)
    assert added > 0 and f"decoded images cached in {default_cache_dir()} ({cache_admin.format_size(added)}): " \
        in stdout, stdout
    assert not caught, [str(w.message) for w in caught]  # its first output was torch.jit.save's deprecation
    assert "Warning" not in stderr, stderr[:3000]
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
