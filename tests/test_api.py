"""tools.benchmark (the Python API) on generated data: the numbers and files of in9_eval.py and challenge_eval.py
for the same model, given as a module or by name; nothing left changed after the call (math flags, the module's
modes and tensors, autocast, grad mode, logging, random state); bad input as one UserError."""

from __future__ import annotations

import json
import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

import challenge_eval
import in9_eval
from tests.helpers import TinyCNN, run_in_process, save_torchscript
from tools import benchmark
from tools.api import CHALLENGE_RESULTS_FILE, IN9_RESULTS_FILE, BenchmarkResult, _state_kept
from tools.data import synthetic
from tools.errors import UserError
from tools.in9 import VARIATIONS
from tools.results.matrix import BACKGROUNDS_FILE, FOREGROUNDS_FILE, PREDICTIONS_FILE

TIMING_KEYS = {"wall_time_s", "composites_per_s"}
# where the model came from
MODEL_KEYS = {"arch", "weights", "checkpoint", "identity", "model_record", "checkpoint_format"}
BATCH = 8


def quick(**extra) -> dict:
    return {"device": "cpu", "batch_size": BATCH, "workers": 1, "progress": False, "cache": False, **extra}


class ColorAndNoise(nn.Module):
    """The hand-built colour model's 1000 logits plus a random CNN's, scaled: predictions right and wrong, mapped
    and unmapped, varying from image to image."""

    def __init__(self):
        super().__init__()
        self.color, self.noise = synthetic.ColorEvidenceModel(1000), TinyCNN(1000, seed=7)

    def forward(self, x):
        return self.color(x) + 0.03 * self.noise(x)


class Negated(ColorAndNoise):
    """ColorAndNoise's weights under other code: its logits negated."""

    def forward(self, x):
        return -super().forward(x)


def test_a_modules_code_is_in_its_identity(dataset, tmp_path, one_thread):
    """A run resumed with a module of the same weights but other code (another class) is refused, not served the
    first module's numbers; the record names the class and the file of its code."""
    model, other = ColorAndNoise().eval(), Negated().eval()
    other.load_state_dict(model.state_dict())
    run = {"num_classes": 1000, "challenge": False, "variations": ["original"], "output_dir": tmp_path / "out",
           **quick()}
    benchmark(model, dataset.root, **run)
    with pytest.raises(UserError, match="another model"):
        benchmark(other, dataset.root, resume=True, **run)
    record = json.loads((tmp_path / "out" / IN9_RESULTS_FILE).read_text())["provenance"]["model_record"]
    assert "tests.test_api.ColorAndNoise" in record["settings"]["module classes"]
    assert record["files"]["code tests.test_api"]["path"] == __file__


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    """A 1000-class model and its TorchScript file."""
    model = ColorAndNoise().eval()
    path = tmp_path_factory.mktemp("api") / "model.ts"
    save_torchscript(model, path)
    return model, path


@pytest.fixture(scope="module")
def scripts(dataset, cnn, tmp_path_factory):
    """in9_eval.py --eval-dataset all and challenge_eval.py --full on the CNN's file: their output folders."""
    folder = tmp_path_factory.mktemp("scripts")
    common = ["--data-path", str(dataset.root), "--checkpoint", str(cnn[1]), "--trust-checkpoint", "--device", "cpu",
              "--no-progress", "--batch-size", str(BATCH), "--workers", "1", "--log-level", "WARNING",
              "--no-cache"]  # as quick()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name, main, extra in (("in9", in9_eval.main, ["--eval-dataset", "all"]),
                                  ("challenge", challenge_eval.main, ["--full"])):
            code, _, err = run_in_process(main, [*common, *extra, "--results-file", str(folder / f"{name}.json"),
                                                 "--output-dir", str(folder / name)], _NoCapture())
            assert code == 0, err
    finally:
        torch.set_num_threads(threads)
    return folder


class _NoCapture:
    """capsys's readouterr for a module-scoped fixture, which cannot take capsys."""

    def readouterr(self):
        return "", ""


def without(payload: dict, keys: set) -> dict:
    return {k: v for k, v in payload.items() if k not in keys}


def same_apart_from_model(api: dict, script: dict) -> None:
    """Equal payloads, timing aside, the model's origin aside in the provenance (a module, not a file)."""
    assert without(api, {"provenance", *TIMING_KEYS}) == without(script, {"provenance", *TIMING_KEYS})
    assert without(api["provenance"], MODEL_KEYS) == without(script["provenance"], MODEL_KEYS)


def test_a_module_gives_what_the_scripts_give(dataset, cnn, scripts, tmp_path, one_thread, monkeypatch):
    from tools.models import device_check  # noqa: PLC0415
    checks, check = [], device_check.check_device
    monkeypatch.setattr(device_check, "check_device", lambda *a, **k: checks.append(a) or check(*a, **k))
    out = tmp_path / "out"
    result = benchmark(cnn[0], dataset.root, num_classes=1000, full=True, output_dir=out, **quick())
    assert len(checks) == 1  # the float64 reference is costly: once per call, recorded in both results
    assert isinstance(result, BenchmarkResult)
    in9_script = json.loads((scripts / "in9.json").read_text())
    challenge_script = json.loads((scripts / "challenge.json").read_text())
    in9_api, challenge_api = (json.loads((out / name).read_text()) for name in (IN9_RESULTS_FILE, CHALLENGE_RESULTS_FILE))
    same_apart_from_model(in9_api, in9_script)
    assert in9_api == result.in9 and challenge_api == result.challenge
    # the challenge's device check is the call's one, on the in9 run's first images (the script's: on backgrounds)
    assert challenge_api["provenance"]["device_check"] == in9_api["provenance"]["device_check"]
    for payload in (challenge_api, challenge_script):
        del payload["provenance"]["device_check"]
    same_apart_from_model(challenge_api, challenge_script)
    assert in9_api["provenance"]["arch"] == "module:ColorAndNoise"
    assert 0 < in9_api["mixed_rand"]["accuracy"] < in9_api["original"]["accuracy"]  # not a trivial model
    assert 0 < challenge_api["vulnerable"] < challenge_api["total"]
    assert in9_api["provenance"]["normalization"] == in9_script["provenance"]["normalization"]
    # the typed numbers are the files' numbers
    assert set(result.accuracy) == set(VARIATIONS)
    for name in VARIATIONS:
        assert round(result.accuracy[name], 4) == in9_script[name]["accuracy"]
    assert round(result.bg_gap, 4) == in9_script["bg_gap"]
    assert round(result.challenge_accuracy, 4) == challenge_script["challenge_accuracy"]
    assert (result.vulnerable, result.foregrounds) == (challenge_script["vulnerable"], challenge_script["total"])
    # --full's files, byte for byte
    for name in (PREDICTIONS_FILE, FOREGROUNDS_FILE, BACKGROUNDS_FILE):
        assert (out / name).read_bytes() == (scripts / "challenge" / name).read_bytes()
    assert result.files["in9"] == out / IN9_RESULTS_FILE and result.files["challenge"] == out / CHALLENGE_RESULTS_FILE
    with pytest.raises(AttributeError):
        result.challenge_accuracy = 0.0  # frozen


def test_a_model_name_gives_what_the_scripts_give(dataset, cnn, scripts, one_thread):
    result = benchmark(f"file:{cnn[1]}", dataset.root, full=True, trust_checkpoint=True, **quick())
    in9_script = json.loads((scripts / "in9.json").read_text())
    assert result.in9 == in9_script  # the same file, so the same provenance too
    challenge_script = json.loads((scripts / "challenge.json").read_text())
    assert result.challenge["provenance"].pop("device_check") == result.in9["provenance"]["device_check"]
    del challenge_script["provenance"]["device_check"]  # the script checks on its first backgrounds
    assert without(result.challenge, TIMING_KEYS) == without(challenge_script, TIMING_KEYS)
    assert result.files == {}  # no output_dir: nothing written


def test_nothing_is_left_changed(dataset, one_thread):
    """The math flags a Runtime sets, the module's modes and tensors (channels-last moves them), the caller's
    autocast and grad mode, logging and every random generator are as they were; inside, the evaluation ran
    in fp32 without autocast or gradients."""
    seen = []

    class Recorder(nn.Module):
        def __init__(self, inner: nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            seen.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled(), x.dtype))
            return self.inner(x)

    model = TinyCNN(9, seed=3)
    model.fc.requires_grad_(False)
    recorder = Recorder(model).train()
    model.conv.train()  # modes as a training loop may leave them: mixed
    model.fc.eval()
    flags = (True, True, True, False)  # TF32 on, autotuning, not deterministic: none of them fp32's
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark, \
        torch.backends.cudnn.deterministic = flags
    before = {name: (t, t.data_ptr(), t.stride(), t.requires_grad) for name, t in model.state_dict(keep_vars=True).items()}
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    states = random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            benchmark(recorder, dataset.root, num_classes=9, variations=["original"], challenge=False,
                      channels_last=True, **quick())
            assert torch.is_autocast_enabled("cpu")
        after_flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
                       torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark, \
            torch.backends.cudnn.deterministic = (False, True, False, False)
    assert after_flags == flags
    # every pass but the one of the start-up device check's float64 reference ran in fp32
    assert [record[2] for record in seen].count(torch.float64) == 1
    assert seen and all(record in {(False, False, torch.float32), (False, False, torch.float64)} for record in seen)
    assert (recorder.training, model.conv.training, model.fc.training) == (True, True, False)
    after = {name: (t, t.data_ptr(), t.stride(), t.requires_grad) for name, t in model.state_dict(keep_vars=True).items()}
    assert after == before  # the same tensors, in place, with their strides and requires_grad
    assert torch.is_grad_enabled()
    assert (root.handlers, root.level) == (handlers, level)
    assert random.getstate() == states[0]
    assert np.array_equal(np.random.get_state()[1], states[1])
    assert torch.equal(torch.get_rng_state(), states[2])


@pytest.mark.parametrize("call, message", [
    (lambda root: benchmark(TinyCNN(10, 0), root, **quick()), "has 10 classes"),
    (lambda root: benchmark(TinyCNN(1000, 0), root, num_classes=9, **quick()), "says a 9-class model"),
    (lambda root: benchmark(TinyCNN(9, 0), root / "missing", **quick()), "does not exist"),
    (lambda root: benchmark(TinyCNN(9, 0), root, mean=(0.5, 0.5, 0.5), **quick()), "mean without std"),
    (lambda root: benchmark(TinyCNN(9, 0), root, precision="fp8", **quick()), "unknown precision 'fp8'"),
    (lambda root: benchmark(TinyCNN(9, 0), root, variations=["mixed"], **quick()), "unknown variation"),
    (lambda root: benchmark(nn.Linear(3, 9), root, **quick()), "the module fails on a 2x3x224x224 input"),
    (lambda root: benchmark("resnet50", root, mean=(0.5,) * 3, std=(0.5,) * 3, **quick()),
     "takes its normalisation from its source"),
    (lambda root: benchmark("nosuchsource:x", root, **quick()), "unknown model source"),
    (lambda root: benchmark(42, root, **quick()), "must be an nn.Module or a model name"),
])
def test_bad_input_is_one_user_error(dataset, call, message):
    with pytest.raises(UserError, match=message):
        call(dataset.root)


def _benchmark_in_a_group(root, model_path, output_dir):
    """What one of torchrun's processes does: join the group, then call benchmark as in one process."""
    from tools import distributed  # noqa: PLC0415
    distributed.setup(torch.device("cpu"))
    result = benchmark(f"file:{model_path}", root, output_dir=output_dir, trust_checkpoint=True, **quick())
    return json.dumps({"in9": result.in9, "challenge": without(result.challenge, TIMING_KEYS),
                       "files": sorted(result.files)})


def test_a_process_group_shares_the_work(dataset, cnn, scripts, tmp_path):
    from tests.helpers import run_in_processes  # noqa: PLC0415
    ranks = run_in_processes(_benchmark_in_a_group, 2, tmp_path, str(dataset.root), str(cnn[1]), str(tmp_path / "out"))
    in9_script = json.loads((scripts / "in9.json").read_text())
    ranks = [json.loads(rank) for rank in ranks]
    for rank in ranks:  # every process has the whole result; rank 0 alone writes
        assert without(rank["in9"], {"provenance"}) == without(in9_script, {"provenance"})
        assert rank["challenge"]["challenge_accuracy"] == json.loads((scripts / "challenge.json").read_text())[
            "challenge_accuracy"]
    assert ranks[0]["files"] == ["challenge", "in9"] and ranks[1]["files"] == []
    assert json.loads((tmp_path / "out" / IN9_RESULTS_FILE).read_text()) == ranks[0]["in9"]


def test_state_kept_restores_gradients_converted_in_place():
    """A dtype change stands in for a device move: nn.Module._apply converts a gradient's data in place, so the
    gradient tensor must get its own data back before it is reattached."""
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    weight, grad, grad_values = model.weight, model.weight.grad, model.weight.grad.clone()
    with _state_kept(model):
        model.to(torch.float64)
        assert model.weight.grad.dtype == torch.float64
    assert model.weight is weight and model.weight.grad is grad
    assert grad.dtype == weight.dtype == torch.float32 and torch.equal(grad, grad_values)


def test_benchmark_leaves_a_module_with_gradients_as_it_was(dataset, one_thread):
    """In a training loop the module has gradients; channels-last moves them, and they come back as they were."""
    model = TinyCNN(9, seed=3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    before = {name: (p.grad, p.grad.data_ptr(), p.grad.stride(), p.grad.clone()) for name, p in model.named_parameters()}
    benchmark(model, dataset.root, num_classes=9, variations=["original"], challenge=False, channels_last=True,
              **quick())
    after = {name: (p.grad, p.grad.data_ptr(), p.grad.stride(), p.grad) for name, p in model.named_parameters()}
    for name, (grad, pointer, stride, values) in before.items():
        assert after[name][:3] == (grad, pointer, stride), name
        assert torch.equal(after[name][3], values), name
