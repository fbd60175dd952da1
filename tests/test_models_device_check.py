"""The start-up device check: a hidden cast to bf16 is caught on the CPU and refused in one line (exit 2) unless
--allow-inexact-device, which the provenance records; an honest model passes, and only then do the results say
`exact: true`; a model with no float64 reference (a weight-only int8 or an fp8 head, a kernel only one device has) is
refused the same way on every route that evaluates (the scripts, the zoo, the Python API, train.py's evaluation), and
with the flag runs recorded as unverified."""

from __future__ import annotations

import functools
import json
import threading
import warnings

import pytest
import torch
from torch import nn

import challenge_eval
import in9_eval
from tests.helpers import TinyCNN, check_error, run_in_process
from tools.errors import UserError
from tools.in9 import IN9_MEAN, IN9_STD
from tools.models.boundary import LoadedModel, PixelModel
from tools.models.device_check import CHECK_IMAGES, TOLERANCE, Float64Everywhere, check_device, relative_deviation
from tools.models.programs import ExportedModule
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


E4M3 = torch.float8_e4m3fn


class Float8Head(nn.Module):
    """TinyCNN's features classified by a layer that multiplies in fp8 through `torch._scaled_mm`, as float8
    training libraries' linear layers do: it runs on the CPU, and its float64 copy cannot (fp8 operands only)."""

    def __init__(self, num_classes: int = 9):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.conv = nn.Conv2d(3, 16, 5, stride=4)
        self.weight = nn.Parameter(torch.randn(16, 16, generator=gen))
        self.num_classes = num_classes
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=gen))

    def forward(self, x):
        features = torch.relu(self.conv(x)).mean(dim=(2, 3))
        one = torch.ones((), device=x.device)
        logits = torch._scaled_mm(features.to(E4M3), self.weight.to(E4M3).t(), scale_a=one, scale_b=one,
                                  out_dtype=torch.float32)
        return logits[:, :self.num_classes]


class Int8WeightHead(nn.Module):
    """TinyCNN's features classified by a weight-only int8 layer through `torch._weight_int8pack_mm`, as weight-only
    quantisation libraries' CPU layers multiply: it runs on the CPU in fp32 at every torch the toolkit supports, and
    its float64 copy cannot (the kernel takes fp32, fp16 or bf16 activations only)."""

    def __init__(self, num_classes: int = 9):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        self.conv = nn.Conv2d(3, 16, 5, stride=4)
        self.register_buffer("weight", torch.randint(-127, 128, (16, 16), dtype=torch.int8, generator=gen))
        self.register_buffer("scales", torch.rand(16, generator=gen) / 16)
        self.num_classes = num_classes
        with torch.no_grad():
            self.conv.weight.copy_(torch.randn(self.conv.weight.shape, generator=gen))

    def forward(self, x):
        features = torch.relu(self.conv(x)).mean(dim=(2, 3))
        return torch._weight_int8pack_mm(features, self.weight, self.scales)[:, :self.num_classes]


def float8_head() -> Float8Head:
    """A Float8Head, where this torch multiplies fp8 on the CPU."""
    try:
        Float8Head()(torch.zeros(1, 3, 64, 64))
    except NotImplementedError:
        pytest.skip(f"torch {torch.__version__} has no CPU kernel for aten::_scaled_mm (fp8 matmul)")
    return Float8Head()


# the models with no float64 reference at all, by the operation that has no float64 form
NO_FLOAT64_FORM = {"int8": (Int8WeightHead, r"aten\._weight_int8pack_mm"), "fp8": (float8_head, r"aten\._scaled_mm")}
NO_REFERENCE = Int8WeightHead  # the routes' model: one that runs at every torch the toolkit supports
NO_REFERENCE_OPERATION = "_weight_int8pack_mm"


@pytest.mark.parametrize("name", ["uncopyable", *NO_FLOAT64_FORM])
def test_a_model_without_a_reference_is_refused_unless_allowed_and_then_unverified(name):
    model = Unreferenceable(TinyCNN(9, seed=1)) if name == "uncopyable" else NO_FLOAT64_FORM[name][0]()
    with pytest.raises(UserError, match=r"no float64 reference of the model .*--allow-inexact-device") as info:
        check_device(loaded(model), Runtime(CPU), images())
    assert "\n" not in str(info.value)
    check = check_device(loaded(model), Runtime(CPU), images(), allow_inexact=True)
    assert check.passed is None and check.verified is False
    record = check.describe()
    assert record["reference"] is None and record["verified"] is False and record["allowed_inexact"] is True


@pytest.mark.parametrize("name", NO_FLOAT64_FORM)
def test_the_reason_names_the_operation_with_no_float64_form(name):
    head, operation = NO_FLOAT64_FORM[name]
    with pytest.raises(UserError, match=operation):
        check_device(loaded(head()), Runtime(CPU), images())
    with pytest.raises(UserError, match=operation):  # a program's too, out of its interpreter's message
        check_device(loaded(traced(head())), Runtime(CPU), images())


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
    provenance = json.loads((tmp_path / "results.json").read_text())["provenance"]
    check = provenance["device_check"]
    assert check["passed"] is False and check["allowed_inexact"] is True and check["images"] == CHECK_IMAGES
    assert check["max_relative_deviation"] > TOLERANCE and check["reference"] == "float64 on the CPU"
    assert check["verified"] is False and provenance["exact"] is False and provenance["exact_mode"] is True


def test_an_honest_run_records_its_check(dataset, color_ts, tmp_path, capsys):
    code, _, err = run_in_process(in9_eval.main, script_argv(dataset, color_ts[9], tmp_path), capsys)
    assert code == 0, err
    provenance = json.loads((tmp_path / "results.json").read_text())["provenance"]
    check = provenance["device_check"]
    assert check["passed"] is True and check["device"] == "cpu" and check["max_relative_deviation"] <= TOLERANCE
    assert check["verified"] is True and check["batch_dependence"] is None and check["batch_size"] == 16
    assert provenance["exact"] is True and provenance["exact_mode"] is True


def test_exact_is_never_a_default(dataset, color_ts, tmp_path):
    """A run that no start-up check verified (the library's run_in9 called alone) does not say it is exact."""
    from tools.in9.evaluate import In9Config, list_in9_files, run_in9  # noqa: PLC0415
    from tools.models.sources import load_model  # noqa: PLC0415
    run = run_in9(load_model(checkpoint=color_ts[9], trust=True), Runtime(CPU),
                  list_in9_files(dataset.root, ["original"], 1),
                  In9Config(("original",), progress=False, workers=1))
    assert run.provenance["exact"] is False and run.provenance["exact_mode"] is True
    assert "device_check" not in run.provenance


# ----------------------------------------------------------------------------------------------------------
# No float64 reference, on every route that evaluates

@pytest.fixture(scope="module")
def no_reference(tmp_path_factory):
    """The model without a float64 reference as a TorchScript file (what a user would hand the scripts and the zoo)."""
    path = tmp_path_factory.mktemp("no_reference") / "int8.ts"
    torch.jit.save(traced(NO_REFERENCE()), str(path))
    return path


def unverified(provenance: dict) -> None:
    """The record of a run that went on with --allow-inexact-device without a reference: not exact, unverified."""
    assert provenance["exact"] is False and provenance["exact_mode"] is True
    check = provenance["device_check"]
    assert check["verified"] is False and check["reference"] is None and NO_REFERENCE_OPERATION in check["unavailable"]
    assert check["allowed_inexact"] is True


@pytest.mark.parametrize("main", [in9_eval.main, challenge_eval.main], ids=["in9_eval", "challenge_eval"])
@pytest.mark.slow
def test_the_scripts_refuse_a_model_without_a_reference_unless_allowed(main, dataset, no_reference, tmp_path, capsys):
    extra = ["--no-cache"] if main is challenge_eval.main else []
    line = check_error(*run_in_process(main, script_argv(dataset, no_reference, tmp_path, *extra), capsys))
    assert "no float64 reference" in line and NO_REFERENCE_OPERATION in line and "--allow-inexact-device" in line
    assert not (tmp_path / "results.json").exists()
    code, _, err = run_in_process(main, script_argv(dataset, no_reference, tmp_path, *extra, "--allow-inexact-device"),
                                  capsys)
    assert code == 0, err
    unverified(json.loads((tmp_path / "results.json").read_text())["provenance"])


def test_the_python_api_refuses_a_model_without_a_reference_unless_allowed(dataset, tmp_path):
    from tools import benchmark  # noqa: PLC0415
    settings = {"num_classes": 9, "device": "cpu", "batch_size": 8, "workers": 1, "progress": False,
                "cache": False, "variations": ["original"]}
    with pytest.raises(UserError, match="no float64 reference"):
        benchmark(NO_REFERENCE().eval(), dataset.root, **settings)
    result = benchmark(NO_REFERENCE().eval(), dataset.root, allow_inexact_device=True, **settings)
    unverified(result.in9["provenance"])
    unverified(result.challenge["provenance"])


@pytest.mark.slow
def test_the_zoo_refuses_a_model_without_a_reference_unless_allowed(dataset, no_reference, tmp_path, capsys):
    from tools import zoo  # noqa: PLC0415
    spec, output = f"file:{no_reference}", tmp_path / "zoo"
    argv = ["--data-path", str(dataset.root), "--models", spec, "--output-dir", str(output), "--device", "cpu",
            "--no-progress", "--no-cache", "--no-leaderboard", "--batch-size", "8", "--trust-checkpoint"]
    code, out, err = run_in_process(zoo.main, argv, capsys)
    assert code == zoo.EXIT_SOME_FAILED and f"{spec}: failed" in out
    assert [line for line in err.splitlines() if "no float64 reference" in line], err
    code, out, err = run_in_process(zoo.main, [*argv, "--allow-inexact-device"], capsys)
    assert code == 0, err
    payload = json.loads(zoo.results_path(output, zoo.parse_model_spec(spec)).read_text())
    unverified(payload["in9"]["provenance"])
    unverified(payload["challenge"]["provenance"])


@pytest.mark.slow
def test_train_s_evaluation_checks_the_model_as_the_scripts_do(dataset, tmp_path):
    """train.py evaluates its checkpoint and starting point through `evaluate`: it runs the start-up check too."""
    from tools.training.config import TrainConfig  # noqa: PLC0415
    from tools.training.evaluation import evaluate  # noqa: PLC0415
    settings = {"data_path": dataset.root, "output_dir": tmp_path, "eval_data": dataset.root, "eval_batch_size": 8,
                "workers": 1, "progress": False, "device": "cpu"}
    with pytest.raises(UserError, match="no float64 reference"):
        evaluate(loaded(NO_REFERENCE()), TrainConfig(**settings), Runtime(CPU), tmp_path / "refused")
    assert not (tmp_path / "refused" / "in9.json").exists()
    found = evaluate(loaded(NO_REFERENCE()), TrainConfig(**settings, allow_inexact_device=True), Runtime(CPU),
                     tmp_path / "allowed")
    unverified(found["in9"]["provenance"])
    honest = evaluate(loaded(TinyCNN(9, seed=1)), TrainConfig(**settings), Runtime(CPU), tmp_path / "honest")
    assert honest["in9"]["provenance"]["exact"] is True
    assert honest["in9"]["provenance"]["device_check"]["verified"] is True
    from tools.training.config import build_parser, config_from_args  # noqa: PLC0415 (train.py's flag reaches it)
    argv = ["--data-path", str(dataset.root), "--eval-data", str(dataset.root), "--allow-inexact-device"]
    assert config_from_args(build_parser().parse_args(argv)).allow_inexact_device


def _checked_in_a_group() -> dict:
    """Rank 1's model has no reference (allowed), rank 0's is honest: rank 0's record, which it would write."""
    from tools import distributed  # noqa: PLC0415
    from tools.models.device_check import check_run  # noqa: PLC0415
    group = distributed.setup(CPU)
    model = Unreferenceable(TinyCNN(9, seed=1)) if group.rank == 1 else TinyCNN(9, seed=1)
    return check_run(loaded(model), Runtime(CPU, group=group), images(), allow_inexact=True, batch_size=4)


@pytest.mark.slow
def test_under_torchrun_a_run_is_verified_only_where_every_process_verified_it(tmp_path):
    from tests.helpers import run_in_processes  # noqa: PLC0415
    first, second = run_in_processes(_checked_in_a_group, 2, tmp_path)
    assert second["verified"] is False and second["reference"] is None
    assert first["passed"] is True and first["verified"] is False and first["unverified_elsewhere"] is True


def test_merged_shards_are_exact_only_where_every_shard_was():
    from tools.models.device_check import combined, record_check  # noqa: PLC0415
    verified, unverified_check = ({"verified": flag, "device": f"cuda:{i}"} for i, flag in enumerate((True, False)))
    shards = [{"exact_mode": True, "exact": False, "data": i} for i in range(3)]
    for shard, check in zip(shards, (verified, unverified_check, verified)):
        record_check(shard, check)
    assert [shard["exact"] for shard in shards] == [True, False, True]
    merged = combined(shards)
    assert merged["exact"] is False and merged["device_check"] == unverified_check and merged["data"] == 0
    assert combined([shards[0], shards[2]])["exact"] is True


class CastsInChannelsLast(nn.Module):
    """fp32 logits, except where its input is laid out channels-last: then rounded through bf16 first (a kernel of
    lower precision in one setting that the resume key does not hold, as on one device and not another)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 9, 16, stride=16)

    def forward(self, x):
        if not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
            x = x.bfloat16().float()
        return self.conv(x).mean((2, 3))


@pytest.mark.parametrize("first_verified", [False, True])
@pytest.mark.slow
def test_a_run_resumes_only_predictions_made_under_its_own_verdict(dataset, tmp_path, first_verified):
    """A run the check did not verify (allowed on a device where the model computes in bf16), resumed where it
    verifies: the resumed predictions are the unverified run's, so the results may not say `exact: true`; the
    resume is refused, for in9 and the challenge alike, naming why (and the other way round)."""
    from tools import benchmark  # noqa: PLC0415
    settings = {"num_classes": 9, "mean": None, "device": "cpu", "batch_size": 4, "workers": 1, "progress": False,
                "cache": False, "variations": ["original"], "output_dir": tmp_path / "out"}
    inexact = {"channels_last": True, "allow_inexact_device": True}
    first, then = ({}, inexact) if first_verified else (inexact, {})
    made = benchmark(CastsInChannelsLast().eval(), dataset.root, **first, **settings)
    assert made.in9["provenance"]["exact"] is first_verified
    state = tmp_path / "out" / "in9_state.json"
    with pytest.raises(UserError, match="the start-up device check verified the model in "
                                        f"{'the run that wrote it' if first_verified else 'this run'}"):
        benchmark(CastsInChannelsLast().eval(), dataset.root, resume=True, challenge=False, **then, **settings)
    state.unlink()  # in9 made afresh: the challenge's state is refused alike
    with pytest.raises(UserError, match="whether the start-up device check verified the model differ"):
        benchmark(CastsInChannelsLast().eval(), dataset.root, resume=True, **then, **settings)
    state.unlink()  # under the first run's verdict, its challenge state is resumed
    again = benchmark(CastsInChannelsLast().eval(), dataset.root, resume=True, **first, **settings)
    assert again.in9["provenance"]["exact"] is again.challenge["provenance"]["exact"] is first_verified


@pytest.mark.slow
def test_the_zoo_sets_aside_the_runs_of_another_verdict(dataset, tmp_path, capsys):
    """The zoo resumes a model's runs from their saved state: one made where the check did not verify the model
    (allowed) is set aside where it verifies, not resumed into results that say `exact: true`."""
    from tools import zoo  # noqa: PLC0415
    path = tmp_path / "casts.pt"
    torch.save(CastsInChannelsLast().eval(), path)
    spec, output = f"file:{path}", tmp_path / "zoo"
    argv = ["--data-path", str(dataset.root), "--models", spec, "--output-dir", str(output), "--device", "cpu",
            "--no-progress", "--no-cache", "--no-leaderboard", "--batch-size", "8", "--trust-checkpoint"]
    code, out, err = run_in_process(zoo.main, [*argv, "--channels-last", "--allow-inexact-device"], capsys)
    assert code == 0, err
    results = zoo.results_path(output, zoo.parse_model_spec(spec))
    assert json.loads(results.read_text())["in9"]["provenance"]["exact"] is False
    results.unlink()  # as if stopped before its results were written: its runs' state is left
    code, out, err = run_in_process(zoo.main, argv, capsys)
    assert code == 0, err
    assert "set aside" in err
    payload = json.loads(results.read_text())
    assert payload["in9"]["provenance"]["exact"] is payload["challenge"]["provenance"]["exact"] is True


# ----------------------------------------------------------------------------------------------------------
# Logits that are no numbers

class NaNWeights(nn.Module):
    """A classifier whose weights hold NaN (torchvision's IMAGENET1K_FEATURES VGG weights ship such a head): every
    logit is NaN on the device and in float64 alike, which compare equal."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3, 9)
        with torch.no_grad():
            self.head.weight.fill_(float("nan"))

    def forward(self, x):
        return self.head(x.mean((2, 3)))


def test_nan_logits_are_refused_unless_allowed_and_never_verified(dataset):
    """NaN logits give an argmax that means nothing: the check refuses them (it passed them before, their NaNs
    being equal to the reference's), and with allow_inexact_device the run is recorded unverified."""
    from tools import benchmark  # noqa: PLC0415
    settings = {"num_classes": 9, "device": "cpu", "batch_size": 8, "workers": 1, "progress": False,
                "cache": False, "variations": ["original"], "challenge": False}
    with pytest.raises(UserError, match="NaN") as error:
        benchmark(NaNWeights().eval(), dataset.root, **settings)
    assert "\n" not in str(error.value) and "allow_inexact_device=True" in str(error.value)
    result = benchmark(NaNWeights().eval(), dataset.root, allow_inexact_device=True, **settings)
    check = result.in9["provenance"]["device_check"]
    assert result.in9["provenance"]["exact"] is False and check["verified"] is False and check["not_finite"]


def _compiled_as_other_kernels(model, **options):
    """A stand-in for torch.compile whose kernels give other logits than eager (Inductor's approximate division
    does so in the last bits, which turns a near tie): here plainly other, so that a prediction shows it."""
    return lambda x: -model(x)


@pytest.mark.parametrize("other", ["--compile", "--channels-last"])
@pytest.mark.slow
def test_a_run_resumes_no_state_saved_under_another_arithmetic(other, dataset, color_ts, tmp_path, monkeypatch,
                                                              capsys):
    """A challenge state saved by a --compile run (not exact, its re-check off with --recheck-margin 0; the start-up
    check, eager, verified the model) or a --channels-last one is resumed by a run without the flag only where they
    agree: before, the keys were the same, so the eager run resumed the compiled predictions into results that say
    `exact: true`."""
    monkeypatch.setattr(torch, "compile", _compiled_as_other_kernels)
    argv = script_argv(dataset, color_ts[9], tmp_path, "--no-cache", "--recheck-margin", "0", "--batch-size", "8")
    code, _, err = run_in_process(challenge_eval.main, [*argv, other], capsys)
    assert code == 0, err
    line = check_error(*run_in_process(challenge_eval.main, [*argv, "--resume"], capsys))
    assert "challenge_state.npz belongs to another run" in line


@pytest.mark.slow
def test_the_zoo_sets_aside_the_runs_of_another_arithmetic(dataset, color_ts, tmp_path, monkeypatch, capsys):
    """The zoo's runs of a model made with --compile (--recheck-margin 0) are set aside, not resumed, by a run
    without it, whose results then say `exact: true` of eager predictions only."""
    from tools import zoo  # noqa: PLC0415
    monkeypatch.setattr(torch, "compile", _compiled_as_other_kernels)
    spec, output = f"file:{color_ts[9]}", tmp_path / "zoo"
    argv = ["--data-path", str(dataset.root), "--models", spec, "--output-dir", str(output), "--device", "cpu",
            "--no-progress", "--no-cache", "--no-leaderboard", "--batch-size", "8", "--trust-checkpoint",
            "--recheck-margin", "0"]
    code, out, err = run_in_process(zoo.main, [*argv, "--compile"], capsys)
    assert code == 0, err
    results = zoo.results_path(output, zoo.parse_model_spec(spec))
    compiled = json.loads(results.read_text())
    results.unlink()  # as if stopped before its results were written: its runs' state is left
    code, out, err = run_in_process(zoo.main, argv, capsys)
    assert code == 0, err
    assert "set aside" in err
    payload = json.loads(results.read_text())
    assert payload["in9"]["provenance"]["exact"] is payload["challenge"]["provenance"]["exact"] is True
    assert payload["in9"]["original"]["accuracy"] != compiled["in9"]["original"]["accuracy"]
    fresh = tmp_path / "fresh"
    code, out, err = run_in_process(zoo.main, [*argv[:5], str(fresh), *argv[6:]], capsys)
    assert code == 0, err
    again = json.loads(zoo.results_path(fresh, zoo.parse_model_spec(spec)).read_text())
    assert again["in9"]["original"] == payload["in9"]["original"]
    assert again["challenge"]["challenge_accuracy"] == payload["challenge"]["challenge_accuracy"]


@pytest.mark.parametrize("other", ["channels_last", "decoder", "device", "cpu_threads"])
@pytest.mark.slow
def test_in9_resumes_and_merges_only_predictions_made_alike(other, dataset, color_ts, tmp_path, monkeypatch, capsys,
                                                             request):
    """in9's saved state and its shards hold where their predictions were made: the memory format, the JPEG decoder
    (another libjpeg decodes a JPEG to other pixels), the device model (another CPU instruction set or GPU, or
    torch, picks other kernels) and on the CPU the intra-op thread count (which splits the sums: before, a run at
    another count resumed and merged them). A run made otherwise neither resumes them (naming what differs) nor
    merges with them."""
    request.addfinalizer(functools.partial(torch.set_num_threads, torch.get_num_threads()))
    import PIL  # noqa: PLC0415

    from tools import merge  # noqa: PLC0415
    argv = script_argv(dataset, color_ts[9], tmp_path, "--batch-size", "8", "--eval-dataset", "all")

    def made_otherwise():
        if other == "channels_last":
            return ["--channels-last"]
        if other == "decoder":
            monkeypatch.setattr(PIL, "__version__", "0.0.1")
        elif other == "cpu_threads":  # the CPU's sums are split by thread: other last bits
            torch.set_num_threads(torch.get_num_threads() % 4 + 1)
        else:
            monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "another ISA")
        return []

    code, _, err = run_in_process(in9_eval.main, argv, capsys)
    assert code == 0, err
    for index in range(2):
        extra = made_otherwise() if index else []
        code, _, err = run_in_process(in9_eval.main, [*argv, "--shard", f"{index}/2", *extra], capsys)
        assert code == 0, err
    with pytest.raises(UserError, match="the in9 shards come from different runs"):
        merge.merge_in9(merge.find_shards([tmp_path])["in9"])
    line = check_error(*run_in_process(in9_eval.main, [*argv, "--resume", *made_otherwise()], capsys))
    assert f"it differs in {other}" in line
