"""A torchvision built for another torch fails on import ("operator torchvision::nms does not exist"): every entry
point that imports it (the root scripts, the console scripts' functions, `python -m tools.x`, `from tools import
benchmark`) says in one line that torch and torchvision are installed as a pair, and how. The failure is made by
an import hook (a sitecustomize on PYTHONPATH) in the commands' processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import run_forked, save_torchscript
from tools.data import synthetic
from tools.models.architectures import SMALL_CNN

ROOT = Path(__file__).resolve().parents[1]
FAILURE = "operator torchvision::nms does not exist"
HOOK = f'''
import importlib.abc, sys

class MismatchedTorchvision(importlib.abc.MetaPathFinder):
    """`import torchvision` fails as a torchvision built for another torch does."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            raise RuntimeError("{FAILURE}")
        return None

sys.meta_path.insert(0, MismatchedTorchvision())
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mismatch")
    (folder / "hook").mkdir()
    (folder / "hook" / "sitecustomize.py").write_text(HOOK)
    data = synthetic.generate(folder / "data", per_class=1, seed=2).root
    train = synthetic.generate(folder / "train", per_class=1, seed=3, split="train").root
    model = folder / "color9.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9), model)
    return folder, data, train, model


def api_call(data: Path, out: Path) -> str:
    return (f"import torch\nfrom tools import benchmark\nfrom tools.data.synthetic import ColorEvidenceModel\n"
            f"benchmark(ColorEvidenceModel(9), {str(data)!r}, challenge=False, device='cpu', progress=False, "
            f"output_dir={str(out)!r})")


@pytest.mark.slow
def test_every_entry_point_says_torch_and_torchvision_go_together(setup):
    folder, data, train, model = setup
    common = ["--device", "cpu", "--no-progress"]
    commands = {
        "in9_eval.py": [str(ROOT / "in9_eval.py"), "--data-path", str(data), "--checkpoint", str(model), *common],
        "challenge_eval.py": [str(ROOT / "challenge_eval.py"), "--data-path", str(data), "--checkpoint", str(model),
                              "--no-cache", "--output-dir", str(folder / "c"), *common],
        "train.py": [str(ROOT / "train.py"), "--data-path", str(train), "--arch", SMALL_CNN, "--weights", "none",
                     "--workers", "0", "--batch-size", "3", "--output-dir", str(folder / "t"), *common],
        "bgc-train (resnet18)": ["-c", "import sys; from tools.training.cli import main; sys.exit(main(sys.argv[1:]))",
                                 "--data-path", str(train), "--arch", "resnet18", "--weights", "none",
                                 "--workers", "0", "--batch-size", "3", "--output-dir", str(folder / "t2"), *common],
        "bgc-zoo": ["-c", "import sys; from tools.zoo import main; sys.exit(main(sys.argv[1:]))", "--models",
                    f"file:{model}", "--data-path", str(data), "--output-dir", str(folder / "z"), *common],
        "python -m tools.zoo": ["-m", "tools.zoo", "--models", "resnet18", "--data-path", str(data), "--output-dir",
                                str(folder / "z2"), *common],
        "from tools import benchmark": ["-c", api_call(data, folder / "api")],
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder / "hook"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    results = run_forked(list(commands.values()), ROOT, env)
    for name, result in zip(commands, results):
        lines = result.stderr.strip().splitlines()
        said = [line for line in lines if "torch and torchvision" in line]
        assert said and FAILURE in said[0] and "pip install" in said[0], (name, result.stderr[-2000:])
        if name == "from tools import benchmark":  # a library call raises the error for its caller
            assert result.returncode == 1 and lines[-1].startswith("tools.errors.UserError: torchvision "), name
        else:
            assert result.returncode == 2 and "Traceback" not in result.stderr, (name, result.stderr[-2000:])
            assert lines[-1].startswith("error: torchvision ") and len(said) == 1, (name, lines)


@pytest.mark.slow
def test_the_demo_passes_the_line_on(setup):
    folder, _, _, _ = setup
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder / "hook"), str(ROOT)]), "OMP_NUM_THREADS": "1"}
    result, = run_forked([["-m", "tools.demo", "--out", str(folder / "demo"), "--per-class", "1"]], ROOT, env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: torchvision "), result.stderr[-2000:]
