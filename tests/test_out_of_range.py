"""Numbers and inputs out of range end in one `error:` line and exit code 2, never a traceback: every numeric flag
of every command is checked by its parser type (negative, zero, huge, nan); a batch the device cannot hold;
torchrun's environment malformed; Ctrl-C while the commands load (exit 130, one line)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.helpers import check_error, load_script, run_in_process
from tools.models.architectures import SMALL_CNN, build_architecture

ROOT = Path(__file__).resolve().parents[1]
HUGE = "100000000"

# (console script, argv, the flag the line names): each numeric flag with a value out of its range
BAD_NUMBERS = [
    ("bgc-in9", ["--batch-size", "0"], "--batch-size"), ("bgc-in9", ["--batch-size", "-3"], "--batch-size"),
    ("bgc-in9", ["--workers", "0"], "--workers"), ("bgc-in9", ["--workers", HUGE], "--workers"),
    ("bgc-in9", ["--seed", "-1"], "--seed"), ("bgc-in9", ["--seed", str(2**64)], "--seed"),
    ("bgc-in9", ["--recheck-margin", "nan"], "--recheck-margin"),
    ("bgc-in9", ["--dist-timeout", "inf"], "--dist-timeout"),
    ("bgc-in9", ["--lora-alpha", "-1"], "--lora-alpha"),
    ("bgc-challenge", ["--top-k", "0"], "--top-k"), ("bgc-challenge", ["--save-every", "-1"], "--save-every"),
    ("bgc-challenge", ["--recheck-margin", "-0.5"], "--recheck-margin"), ("bgc-challenge", ["--seed", "1.5"], "--seed"),
    ("bgc-zoo", ["--batch-size", "0"], "--batch-size"), ("bgc-zoo", ["--workers", "-1"], "--workers"),
    ("bgc-zoo", ["--save-every", "nan"], "--save-every"),
    *[("bgc-train", ["--data-path", "d", flag, value], flag) for flag, value in [
        ("--epochs", "0"), ("--batch-size", "0"), ("--lr", "0"), ("--lr", "nan"), ("--weight-decay", "-1"),
        ("--momentum", "1.5"), ("--warmup-epochs", "-1"), ("--label-smoothing", "2"), ("--crop-scale", "0"),
        ("--swap-prob", "1.5"), ("--swap-same-class-prob", "-0.1"), ("--mixup-alpha", "0"), ("--cutmix-alpha", "-1"),
        ("--swa-start-epoch", "-1"), ("--swa-lr", "0"), ("--lora-rank", "0"), ("--oft-block-size", "0"),
        ("--workers", "-1"), ("--workers", HUGE), ("--seed", "-1"), ("--eval-batch-size", "0"), ("--save-every", "0"),
        ("--dist-timeout", "0")]],
    ("bgc-data", ["build", "--jpeg-quality", "101"], "--jpeg-quality"),
    ("bgc-data", ["build", "--grabcut-iterations", HUGE], "--grabcut-iterations"),
    ("bgc-data", ["build", "--seed", "-1"], "--seed"), ("bgc-data", ["build", "--workers", "0"], "--workers"),
    ("bgc-data", ["verify", "--workers", HUGE], "--workers"),
    ("bgc-data", ["provenance", "--workers", "-2"], "--workers"),
    ("bgc-data", ["fetch", "--timeout", "0"], "--timeout"),
    ("bgc-merge", ["d", "--top-k", "0"], "--top-k"), ("bgc-analysis", ["d", "--top-k", "-1"], "--top-k"),
    ("bgc-demo", ["--per-class", "0"], "--per-class"), ("bgc-demo", ["--per-class", HUGE], "--per-class"),
]


@pytest.fixture(scope="module")
def make_cli():
    yield load_script(ROOT / "docs" / "make_cli.py")
    sys.modules.pop("make_cli", None)


def command_modules(make_cli) -> dict[str, types.ModuleType]:
    return {script: make_cli.importlib.import_module(target.split(":")[0])
            for script, target in make_cli.entry_points().items()}


def every_action(parser: argparse.ArgumentParser):
    for action in parser._actions:
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from every_action(sub)


def test_no_numeric_flag_takes_a_bare_int_or_float(make_cli):
    """The kind, not the examples: a flag typed int or float takes -1, 0, nan and 10**30 alike; each numeric flag
    of every command says its range in its parser type instead."""
    bare = [f"{script} {flag}" for script, module in command_modules(make_cli).items()
            for action in every_action(module.build_parser()) if action.type in (int, float)
            for flag in action.option_strings[:1]]
    assert bare == []


@pytest.mark.parametrize("script, argv, flag", BAD_NUMBERS, ids=[f"{s}-{'_'.join(a)}" for s, a, _ in BAD_NUMBERS])
def test_a_number_out_of_range_is_one_line(make_cli, capsys, monkeypatch, script, argv, flag):
    main = command_modules(make_cli)[script].main
    monkeypatch.setattr(sys, "argv", [f"/venv/bin/{script}"])
    with pytest.raises(SystemExit) as exc:
        main(argv)
    line = check_error(exc.value.code, *capsys.readouterr())
    assert f"argument {flag}: '{argv[-1]}' is not a" in line, line


@pytest.fixture(scope="module")
def state_dict(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("small") / "small.pt"
    torch.save(build_architecture(SMALL_CNN, 9).state_dict(), path)
    return path


@pytest.mark.parametrize("script", ["in9_eval", "challenge_eval"])
def test_a_batch_the_device_cannot_hold_is_refused_before_the_run(script, dataset, state_dict, tmp_path, capsys):
    """--batch-size 100000000 for 18 images: 56 TiB of float32 images (the padded batch tried 15 TB before)."""
    main = __import__(script).main
    line = check_error(*run_in_process(main, ["--data-path", str(dataset.root), "--arch", SMALL_CNN, "--checkpoint",
                                              str(state_dict), "--device", "cpu", "--no-progress", "--no-cache",
                                              "--batch-size", HUGE, "--output-dir", str(tmp_path / "out")], capsys))
    assert f"a batch of {HUGE} images takes" in line and "pass a smaller --batch-size" in line


@pytest.mark.parametrize("environment, says", [
    ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE is 'abc'"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK is '2', not a whole number from 0 to 1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK is '-1'"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE is '0'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK is 'x'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK is '3'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT is 'http'"),
])
@pytest.mark.parametrize("script", ["in9_eval", "train"])
def test_a_malformed_torchrun_environment_is_one_line(script, environment, says, dataset, tiny, state_dict, tmp_path,
                                                       capsys, monkeypatch):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    data = dataset.root if script == "in9_eval" else tiny
    argv = ["--data-path", str(data), "--arch", SMALL_CNN, "--checkpoint", str(state_dict), "--device", "cpu",
            "--no-progress", "--output-dir", str(tmp_path / "out")]
    line = check_error(*run_in_process(__import__(script).main, argv, capsys))
    assert says in line and "torchrun" in line, line


# sitecustomize for the command under test: Ctrl-C (a real SIGINT) as its first import of torch or numpy starts
CTRL_C_AT_IMPORT = """
import os, signal, sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "numpy"):
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, CtrlC())
"""


def ctrl_c_reaches_it() -> None:
    """In the command's process: Ctrl-C as a terminal delivers it, whatever the suite inherited (a shell runs a
    command it puts in the background with SIGINT ignored, and an ignored signal stays ignored across exec)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_while_a_command_loads_is_one_line_and_exit_130(make_cli, tmp_path):
    """Every console script (a wrapper as pip writes it, importing the command's module and calling its main), every
    root script, and `python -m tools...`, interrupted while they import torch or numpy."""
    (tmp_path / "sitecustomize.py").write_text(CTRL_C_AT_IMPORT)
    commands = []
    for script, target in make_cli.entry_points().items():
        module, function = target.split(":")
        (tmp_path / script).write_text(f"import sys\nfrom {module} import {function}\nsys.exit({function}())\n")
        commands.append([str(tmp_path / script)])
    commands += [[script] for script in ("in9_eval.py", "challenge_eval.py", "train.py")]
    commands += [["-m", "tools.zoo"], ["-m", "tools.data"]]
    environment = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for command in commands:
        proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120,
                              env=environment, preexec_fn=ctrl_c_reaches_it)
        assert (proc.returncode, proc.stdout, proc.stderr) == (130, "", "interrupted: rerun the same command\n"), \
            (command, proc.stderr[-2000:])


@pytest.mark.parametrize("settings, says", [
    ({"seed": 2**64}, "seed must be from 0 to 18446744073709551615"), ({"seed": -1}, "seed must be from 0"),
    ({"workers": 10**8}, "workers must be from 1 to"), ({"batch_size": 10**8}, "a batch of 100000000 images takes"),
])
def test_benchmark_refuses_numbers_out_of_range(settings, says, dataset):
    """The Python API: the same ranges as the flags, one UserError."""
    from tools import benchmark  # noqa: PLC0415
    from tools.errors import UserError  # noqa: PLC0415
    with pytest.raises(UserError, match=says):
        benchmark(build_architecture(SMALL_CNN, 9), dataset.root, num_classes=9, variations=["original"],
                  challenge=False, device="cpu", progress=False, cache=False, **settings)
