"""The start-up device check: a hidden cast to bf16 is caught on the CPU and refused in one line (exit 2) unless
--allow-inexact-device, which the provenance records; an honest model passes; a model with no float64 reference
is run, and the provenance says why it was not checked."""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch
from torch import nn

import challenge_eval
import in9_eval
from tests.helpers import TinyCNN, check_error, run_in_process
from tools.in9 import IN9_MEAN, IN9_STD
from tools.models.boundary import LoadedModel, PixelModel
from tools.models.checkpoints import ExportedModule
from tools.models.device_check import CHECK_IMAGES, TOLERANCE, Float64Everywhere, check_device, relative_deviation
from tools.errors import UserError
from tools.runtime import Runtime

CPU = torch.device("cpu")


class HiddenBF16(nn.Module):
    """A classifier that computes in bf16 inside and returns fp32 logits: nothing outside it shows."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner.bfloat16()

    def forward(self, x):
        return self.inner(x.bfloat16()).float()


class Unreferenceable(nn.Module):
    """An honest classifier that cannot be copied (it holds a lock), so no float64 reference can be made."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner, self.lock = inner, threading.Lock()

    def forward(self, x):
        return self.inner(x)


def loaded(classifier: nn.Module) -> LoadedModel:
    return LoadedModel(PixelModel(classifier.eval(), IN9_MEAN, IN9_STD).eval(), 9, None, None, None, None, "test",
                       "test")


def images(count: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (count, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))


def traced(module: nn.Module) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(module.eval(), torch.zeros(2, 3, 64, 64))


def exported(module: nn.Module) -> nn.Module:
    program = torch.export.export(module.eval(), (torch.zeros(2, 3, 64, 64),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},)).module()
    return ExportedModule(program, "export", CPU, names_devices=False)  # as the loader wraps it


FORMATS = {"eager": lambda m: m, "traced": traced, "exported": exported}


@pytest.mark.parametrize("form", FORMATS)
def test_an_honest_model_passes_in_every_format(form):
    check = check_device(loaded(FORMATS[form](TinyCNN(9, seed=1))), Runtime(CPU), images())
    assert check.passed and check.deviation < TOLERANCE / 100 and check.unavailable is None
    assert check.describe()["passed"] is True and "allowed_inexact" not in check.describe()


@pytest.mark.parametrize("form", FORMATS)
def test_a_hidden_bf16_cast_trips_the_check_on_the_cpu_in_every_format(form):
    """The float64 reference runs the same code with the cast widened to float64, so the cast shows."""
    model = loaded(FORMATS[form](HiddenBF16(TinyCNN(9, seed=1))))
    with pytest.raises(UserError, match=r"fp32 logits on cpu differ from float64 .* --allow-inexact-device"):
        check_device(model, Runtime(CPU), images())
    check = check_device(model, Runtime(CPU), images(), allow_inexact=True)
    assert check.passed is False and check.deviation > 10 * TOLERANCE
    assert check.describe()["allowed_inexact"] is True


class InnerAutocast(nn.Module):
    """A classifier that switches bf16 autocast on inside its forward, whatever the run's precision."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.inner(x).float()


def test_autocast_inside_the_model_trips_the_check():
    with pytest.raises(UserError, match="beyond fp32 rounding"):
        check_device(loaded(InnerAutocast(TinyCNN(9, seed=1))), Runtime(CPU), images())


def test_the_reference_widens_every_cast_a_program_makes():
    """The traced program's casts to bf16 and back become float64: it computes what its (bf16) weights mean."""
    program = traced(HiddenBF16(TinyCNN(9, seed=1)))
    x = torch.rand(2, 3, 64, 64, dtype=torch.float64)
    with torch.inference_mode():
        with Float64Everywhere():
            widened = program.double()(x)
        exact = TinyCNN(9, seed=1).bfloat16().double()(x)
    assert widened.dtype == torch.float64
    assert relative_deviation(widened, exact) < 1e-12


def test_a_model_without_a_reference_runs_and_says_why():
    check = check_device(loaded(Unreferenceable(TinyCNN(9, seed=1))), Runtime(CPU), images())
    assert check.passed is None and "lock" in check.unavailable
    assert check.describe()["reference"] is None


def test_relative_deviation_is_relative_to_each_image_s_largest_logit():
    reference = torch.tensor([[10.0, -20.0, 0.0], [0.0, 0.0, 0.0], [1.0, float("inf"), 2.0]])
    assert relative_deviation(reference, reference) == 0
    shifted = reference.clone()
    shifted[0, 2] += 0.002  # 1e-4 of the row's largest logit, 20
    shifted[2, 0] += 0.0001  # 5e-5 of the largest finite one, 2
    assert relative_deviation(shifted, reference) == pytest.approx(1e-4)
    assert relative_deviation(reference + torch.tensor([[0.0], [1e-9], [0.0]]), reference) == float("inf")
    assert relative_deviation(reference.clone().fill_(float("nan")), reference) == float("inf")


@pytest.fixture(scope="module")
def hidden(tmp_path_factory):
    path = tmp_path_factory.mktemp("hidden") / "hidden.ts"
    torch.jit.save(traced(HiddenBF16(TinyCNN(9, seed=1))), str(path))
    return path


def script_argv(dataset, model, out, *extra) -> list[str]:
    return ["--data-path", str(dataset.root), "--checkpoint", str(model), "--trust-checkpoint", "--device", "cpu",
            "--no-progress",
            "--output-dir", str(out), "--results-file", str(out / "results.json"), "--log-level", "WARNING", *extra]


@pytest.mark.parametrize("main", [in9_eval.main, challenge_eval.main], ids=["in9_eval", "challenge_eval"])
def test_the_scripts_refuse_a_hidden_bf16_cast_in_one_line(main, dataset, hidden, tmp_path, capsys):
    extra = ["--no-cache"] if main is challenge_eval.main else []
    line = check_error(*run_in_process(main, script_argv(dataset, hidden, tmp_path, *extra), capsys))
    assert "differ from float64 on the CPU" in line and "--allow-inexact-device" in line
    assert not (tmp_path / "results.json").exists()


def test_the_flag_lets_the_run_go_on_and_records_it(dataset, hidden, tmp_path, capsys):
    code, _, err = run_in_process(in9_eval.main, script_argv(dataset, hidden, tmp_path, "--allow-inexact-device"),
                                  capsys)
    assert code == 0, err
    assert "running anyway (--allow-inexact-device" in err
    check = json.loads((tmp_path / "results.json").read_text())["provenance"]["device_check"]
    assert check["passed"] is False and check["allowed_inexact"] is True and check["images"] == CHECK_IMAGES
    assert check["max_relative_deviation"] > TOLERANCE and check["reference"] == "float64 on the CPU"


def test_an_honest_run_records_its_check(dataset, color_ts, tmp_path, capsys):
    code, _, err = run_in_process(in9_eval.main, script_argv(dataset, color_ts[9], tmp_path), capsys)
    assert code == 0, err
    check = json.loads((tmp_path / "results.json").read_text())["provenance"]["device_check"]
    assert check["passed"] is True and check["device"] == "cpu" and check["max_relative_deviation"] <= TOLERANCE
