"""A mistake on any command line (a mistyped choice, a missing argument, a bad number) is one line on stderr,
`error: ...`, naming the closest valid choice and pointing to -h, and exit code 2: argparse's usage block is not
printed."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.helpers import check_error, load_script

ROOT = Path(__file__).resolve().parents[1]

# (console script, argv, what the line must say): every command and every fixed vocabulary
MISTAKES = [
    ("bgc-in9", ["--eval-dataset", "mixed_sam"], "did you mean mixed_same?"),
    ("bgc-in9", ["--precision", "fp61"], "did you mean fp16?"),
    ("bgc-in9", ["--normalize", "imagenett"], "did you mean imagenet?"),
    ("bgc-in9", ["--log-level", "DEBUH"], "did you mean DEBUG?"),
    ("bgc-in9", ["--batch-size", "many"], "argument --batch-size: 'many' is not a whole number of at least 1"),
    ("bgc-challenge", ["--criterion", "bg-clas"], "did you mean bg-class?"),
    ("bgc-challenge", ["--mask-arithmetic", "binry"], "did you mean binary?"),
    ("bgc-challenge", ["--precision", "bf61"], "did you mean bf16?"),
    ("bgc-train", ["--data-path", "d", "--method", "ermm"], "did you mean erm?"),
    ("bgc-train", ["--data-path", "d", "--method", "erm", "mixupp"], "did you mean mixup?"),
    ("bgc-train", ["--data-path", "d", "--train-variation", "mixed_rnd"], "did you mean mixed_rand?"),
    ("bgc-train", ["--data-path", "d", "--optimizer", "adamm"], "did you mean adamw?"),
    ("bgc-train", ["--data-path", "d", "--peft", "loraa"], "did you mean lora?"),
    ("bgc-train", ["--data-path", "d", "--freeze", "backbon"], "did you mean backbone?"),
    ("bgc-train", ["--data-path", "d", "--precision", "bf61"], "did you mean bf16?"),
    ("bgc-train", [], "the following arguments are required: --data-path"),
    ("bgc-data", ["biuld"], "did you mean build?"),
    ("bgc-data", [], "the following arguments are required"),
    ("bgc-data", ["build", "--image-format", "pnj"], "did you mean png?"),
    ("bgc-data", ["verify", "--split", "trian"], "did you mean train?"),
    ("bgc-data", ["cache", "--max-size", "20X"], "argument --max-size: '20X' is not a size such as 20G"),
    ("bgc-zoo", ["--criterion", "ani"], "did you mean any?"),
    ("bgc-zoo", ["--precision", "tf23"], "did you mean tf32?"),
    ("bgc-merge", ["d", "--kind", "challeng"], "did you mean challenge?"),
    ("bgc-merge", [], "the following arguments are required: DIR"),
    ("bgc-report", ["--log-level", "WARN"], "did you mean WARNING?"),
    ("bgc-analysis", [], "the following arguments are required: OUTPUT_DIR"),
    ("bgc-demo", ["--per-class", "ten"], "argument --per-class: 'ten' is not a whole number from 1 to 1000"),
    ("bgc-demo", ["--outt", "x"], "unrecognized arguments: --outt x; did you mean --out?"),
    # the case a user typed is not a near miss of its own: upper-case choices and flags get their suggestion
    ("bgc-challenge", ["--criterion", "ANY"], "did you mean any?"),
    ("bgc-in9", ["--eval-dataset", "MIXED_RAND"], "did you mean mixed_rand?"),
    ("bgc-report", ["--log-level", "debug"], "did you mean DEBUG?"),
    # a mistyped flag names the closest flag, also with its value glued on by "="
    ("bgc-in9", ["--eval-datset", "mixed_same"], "did you mean --eval-dataset?"),
    ("bgc-challenge", ["--precison=bf16"], "did you mean --precision?"),
    ("bgc-train", ["--data-path", "d", "--batchsize", "8"], "did you mean --batch-size?"),
]


@pytest.fixture(scope="module")
def mains():
    make_cli = load_script(ROOT / "docs" / "make_cli.py")
    try:
        yield {script: make_cli.importlib.import_module(target.split(":")[0]).main
               for script, target in make_cli.entry_points().items()}
    finally:
        sys.modules.pop("make_cli", None)


def test_every_command_is_covered(mains):
    assert set(mains) == {script for script, _, _ in MISTAKES}


@pytest.mark.parametrize("script, argv, says", MISTAKES, ids=[f"{s}-{'_'.join(a) or 'none'}" for s, a, _ in MISTAKES])
def test_a_mistake_is_one_line_with_a_suggestion(mains, capsys, monkeypatch, script, argv, says):
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{script}"])  # as the console script runs it
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    with pytest.raises(SystemExit) as exc:
        mains[script](argv)
    out, err = capsys.readouterr()
    line = check_error(exc.value.code, out, err)
    assert says in line, line
    command = next((f" {word}" for word in ("build", "verify", "cache") if word in argv), "")
    assert line.endswith(f"see `{script}{command} -h`"), line


@pytest.mark.slow
def test_as_a_script_the_line_names_the_script_typed():
    proc = subprocess.run([sys.executable, "in9_eval.py", "--eval-dataset", "mixed_sam"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert check_error(proc.returncode, proc.stdout, proc.stderr) == (
        "error: argument --eval-dataset: invalid choice 'mixed_sam'; did you mean mixed_same? (valid: original, "
        "only_fg, only_bg_b, only_bg_t, no_fg, mixed_same, mixed_rand, mixed_next, all); see `in9_eval.py -h`")
    proc = subprocess.run([sys.executable, "-m", "tools.data", "biuld"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert check_error(proc.returncode, proc.stdout, proc.stderr).endswith("see `python -m tools.data -h`")


def test_a_mistyped_model_source_names_the_closest(dataset, capsys, tmp_path):
    import in9_eval  # noqa: PLC0415
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code = in9_eval.main(["--data-path", str(dataset.root), "--arch", "tim:resnet18", "--device", "cpu",
                              "--output-dir", str(tmp_path / "out"), "--no-progress", "--log-level", "WARNING"])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    line = check_error(code, out, err)
    assert "unknown model source 'tim:'" in line and "did you mean timm:?" in line, line


@pytest.mark.parametrize("ending", ["error", "interrupted"])
def test_what_a_command_cached_is_said_before_its_last_line(ending, tmp_path, capsys):
    """A command that wrote into the cache and then fails (or is interrupted) says where and how much it cached,
    and then its error (or how to go on) as its last line (before, the cache's line came after the error)."""
    from tools import cli  # noqa: PLC0415
    from tools.data import store  # noqa: PLC0415
    from tools.errors import UserError  # noqa: PLC0415

    def main(args):
        store._written[("decoded data", tmp_path)] = 4096  # as a pack writer counts what it wrote
        if ending == "error":
            raise UserError("the model failed")
        raise KeyboardInterrupt

    parser = cli.ArgumentParser(prog="command")
    code = cli.run_main(parser, main, [], on_interrupt="rerun the same command")
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == (2 if ending == "error" else 130)
    assert "decoded data cached: 4.0K" in lines[-2], lines
    assert lines[-1] == ("error: the model failed" if ending == "error" else "interrupted: rerun the same command")
