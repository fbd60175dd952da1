"""Settings own their defaults: the flags' defaults are the config dataclasses' own, argument parsing leaves the
parsed arguments as they were, and parsing a command's flags loads only what the command needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import challenge_eval
import in9_eval
import train
from tests.helpers import run_forked
from tools import options
from tools.challenge import ChallengeConfig, flags, list_challenge_files, run_challenge
from tools.data.layout import DATA_ENV
from tools.models.boundary import LoadedModel, PixelModel
from tools.runtime import Precision, Runtime
from tools.training.config import TrainConfig, config_from_args

REPO = Path(__file__).resolve().parents[1]

LIST_TOOLS_MODULES = "print(__import__('json').dumps(sorted(m for m in sys.modules if m.startswith('tools'))))"
TRAIN_FLAGS = "import train\ntrain.build_parser()"
IN9_EVAL_HELP = ("import runpy\nsys.argv = ['in9_eval.py', '-h']\n"
                 "try:\n    runpy.run_path('in9_eval.py', run_name='__main__')\nexcept SystemExit:\n    pass")


@pytest.fixture(scope="module")
def runs() -> dict:
    """TRAIN_FLAGS and IN9_EVAL_HELP, each run as `python -c` runs it in the repository root, then the tools.*
    modules loaded printed (tests.helpers.run_forked: one start-up for both, each in a fork that has loaded none
    of the toolkit)."""
    codes = [TRAIN_FLAGS, IN9_EVAL_HELP]
    return dict(zip(codes, run_forked([["-c", f"import sys\n{code}\n{LIST_TOOLS_MODULES}"] for code in codes], REPO)))


def loaded_modules(runs: dict, code: str) -> list[str]:
    """The `tools` modules a fresh interpreter has loaded after running `code` in the repository root."""
    proc = runs[code]
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def under(modules: list[str], *packages: str) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in packages)]


@pytest.mark.slow
def test_train_parses_its_flags_without_the_challenge_the_analysis_or_the_report(runs):
    modules = loaded_modules(runs, TRAIN_FLAGS)
    assert "tools.training.config" in modules  # the flags were built
    assert under(modules, "tools.challenge", "tools.results") == []


def test_in9_eval_help_loads_neither_the_challenge_nor_the_data_fetch_and_build(runs):
    modules = loaded_modules(runs, IN9_EVAL_HELP)
    assert "tools.options" in modules  # the flags were built
    assert under(modules, "tools.challenge", "tools.data.download", "tools.data.builder") == []


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_the_challenge_flags_default_to_the_challenge_configs_defaults(precision):
    args = challenge_eval.build_parser().parse_args(["--precision", precision.value])
    assert flags.challenge_config_from_args(args, progress=True) == ChallengeConfig()


def test_a_default_challenge_config_rechecks_near_ties_in_reduced_precision(dataset, one_thread):
    """The re-check margin's default is the config's: a library run in bf16 re-checks near ties as
    challenge_eval.py does, and an fp32 run has nothing to re-check."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(3, 9))
    with torch.no_grad():
        net[2].weight.mul_(1e-3)  # every logit margin far below any sensible re-check margin
    loaded = LoadedModel(PixelModel(net, (0.5,) * 3, (0.25,) * 3), 9, None, None, None, None, "test", "test")
    config = ChallengeConfig(progress=False)
    fast = run_challenge(loaded, Runtime(torch.device("cpu"), Precision.BF16), list_challenge_files(dataset.root, 1),
                         config, workers=1)
    assert fast.rechecked > 0 and fast.unsure == 0
    exact = run_challenge(loaded, Runtime(torch.device("cpu")), list_challenge_files(dataset.root, 1), config,
                          workers=1)
    assert exact.rechecked == 0 and exact.unsure is None
    assert fast.state.verdict.tolist() == exact.state.verdict.tolist()


def test_checking_the_arguments_leaves_them_as_parsed(dataset, monkeypatch):
    monkeypatch.setenv(DATA_ENV, str(dataset.root))
    args = in9_eval.build_parser().parse_args(["--device", "cpu"])
    parsed = dict(vars(args))
    checked = options.check_arguments(args)
    options.runtime_from_args(args)
    assert vars(args) == parsed
    assert checked == options.CheckedArguments(data_path=dataset.root, progress=True)  # $BG_CHALLENGE_DATA, found


def test_the_training_flags_default_to_the_train_configs_defaults(tmp_path, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)  # a machine where the thread default is not the old constant
    args = train.build_parser().parse_args(["--data-path", str(tmp_path)])
    assert config_from_args(args) == TrainConfig(data_path=tmp_path, output_dir=args.output_dir)
