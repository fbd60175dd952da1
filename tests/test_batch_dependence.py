"""A model whose logits for an image depend on the other images of its batch, or on chance, is refused at start-up
with the reason, unless --allow-inexact-device (then recorded as unverified):

- a TorchScript or torch.export program made from a model in training mode (BatchNorm normalising by batch
  statistics, dropout dropping at random), found in its graph, forked branches included, with one line that says
  to call model.eval() before tracing or exporting;
- any other, found by the start-up check's comparison of an image's logits alone in a padded batch of the run's
  shape with the same image beside other images (a module computing batch statistics by hand, a BatchNorm that
  keeps no running statistics, randomness).

Honest models (convolutional and attention ones, in every format, at several batch sizes and memory formats) pass:
at one batch shape a row's logits do not depend on the rows beside it, bit for bit."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torchvision
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import in9_eval
from tests.helpers import TinyCNN, check_error, run_in_process
from tools.errors import UserError
from tools.in9 import IMAGE_SIZE, IN9_MEAN, IN9_STD
from tools.models.boundary import LoadedModel, PixelModel
from tools.models.device_check import check_device
from tools.models.programs import ExportedModule
from tools.models.sources import load_model
from tools.runtime import Runtime

CPU = torch.device("cpu")
SIZE = 32
BATCH = torch.export.Dim("batch", max=2 ** 31 - 1)  # bounded: torch 2.6 guards a ViT's batch against maxsize
EVAL_ADVICE = r"call model\.eval\(\) before tracing or exporting"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """These models are tiny: one intra-op thread."""


def loaded(classifier: nn.Module) -> LoadedModel:
    """As the loaders wrap a classifier (`tools.models.boundary.wrap` puts it in eval mode: an eager module's
    batch norm and dropout then behave; a program's graph keeps the mode it was made in)."""
    return LoadedModel(PixelModel(classifier.eval(), IN9_MEAN, IN9_STD).eval(), 9, None, None, None, None, "test",
                       "test")


def images(count: int = 2, size: int = SIZE) -> torch.Tensor:
    return torch.randint(0, 256, (count, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))


def traced(module: nn.Module, size: int = SIZE) -> torch.jit.ScriptModule:
    """Traced in the mode the module is in (the mistake under test is tracing in training mode)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(module, torch.rand(4, 3, size, size), check_trace=False)


def exported(module: nn.Module, size: int = SIZE, decomposed: bool = False) -> nn.Module:
    # under the math attention kernel, which the exact mode runs: torch 2.6 lays exported attention out as the kernel
    # it was exported with lays it (test_exported_attention_the_exact_kernels_cannot_run_is_refused_at_load)
    with sdpa_kernel([SDPBackend.MATH]):
        program = torch.export.export(module, (torch.rand(4, 3, size, size),), dynamic_shapes=({0: BATCH},))
    if decomposed:  # the core aten operations (`_native_batch_norm_legit_functional`, `native_dropout`)
        program = program.run_decompositions()
    return ExportedModule(program.module(), "export", CPU, names_devices=False)  # as the loader wraps it


def decomposed(module: nn.Module, size: int = SIZE) -> nn.Module:
    return exported(module, size, decomposed=True)


FORMATS = {"traced": traced, "exported": exported, "decomposed": decomposed}


class Normed(nn.Module):
    """A convolution, then a normalisation layer whose running statistics are far from any batch's, then a head."""

    def __init__(self, norm: nn.Module, dropout: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.norm, self.head = nn.Conv2d(3, 8, 3, stride=2), norm, nn.Linear(8, 9)
        self.dropout = nn.Dropout(dropout)
        if getattr(norm, "running_mean", None) is not None:
            norm.running_mean.fill_(3.0)
            norm.running_var.fill_(0.25)

    def forward(self, x):
        return self.head(self.dropout(torch.relu(self.norm(self.conv(x))).mean(dim=(2, 3))))


CULPRITS = {  # made in training mode, each computes what model.eval() would not: (model, operation named)
    "batch_norm": (lambda: Normed(nn.BatchNorm2d(8)), "batch_norm"),
    "dropout": (lambda: Normed(nn.Identity(), dropout=0.5), "dropout"),
    "instance_norm": (lambda: Normed(nn.InstanceNorm2d(8, track_running_stats=True)), "instance_norm"),
}


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("culprit", CULPRITS)
@pytest.mark.slow
def test_a_program_made_in_training_mode_is_refused_with_the_advice_to_call_eval(form, culprit):
    make, operation = CULPRITS[culprit]
    if form == "decomposed" and culprit == "instance_norm":  # decomposed, a batch norm over (1, N * C, H, W)
        operation = "_native_batch_norm_legit_functional"
    program = loaded(FORMATS[form](make().train()))
    with pytest.raises(UserError, match=EVAL_ADVICE) as info:
        check_device(program, Runtime(CPU), images())
    message = str(info.value)
    assert operation in message and "--allow-inexact-device" in message and "\n" not in message
    assert "precision" not in message  # the cause is the mode, not the arithmetic
    check = check_device(program, Runtime(CPU), images(), allow_inexact=True)
    assert check.verified is False and any(operation in found for found in check.training_mode)
    assert check.describe()["training_mode"] == list(check.training_mode)
    # the same model made in eval mode passes
    assert check_device(loaded(FORMATS[form](make().eval())), Runtime(CPU), images()).verified


@pytest.mark.parametrize("form", FORMATS)
@pytest.mark.parametrize("norm", ["instance_norm", "dropout_0"])
@pytest.mark.slow
def test_what_training_mode_leaves_independent_of_the_batch_passes(form, norm):
    """An InstanceNorm without running statistics normalises each image by its own (in either mode); a dropout of
    probability 0 drops nothing: a program made in training mode with only those computes what eval mode does."""
    model = Normed(nn.InstanceNorm2d(8)) if norm == "instance_norm" else Normed(nn.Identity(), dropout=0.0)
    check = check_device(loaded(FORMATS[form](model.train())), Runtime(CPU), images())
    assert check.verified and check.training_mode == ()


def _normalised_branch(x, weight, bias, mean, var):
    return torch.nn.functional.batch_norm(x, mean, var, weight, bias, training=True)


class ForksABatchNorm(Normed):
    """Its batch norm, in training mode, runs in a branch of `torch.jit.fork`: in the fork node's subgraph."""

    def __init__(self):
        super().__init__(nn.BatchNorm2d(8))

    def forward(self, x):
        future = torch.jit.fork(_normalised_branch, self.conv(x), self.norm.weight, self.norm.bias,
                                self.norm.running_mean, self.norm.running_var)
        return self.head(torch.relu(torch.jit.wait(future)).mean(dim=(2, 3)))


def test_batch_statistics_in_a_forked_branch_are_found():
    with pytest.raises(UserError, match=EVAL_ADVICE):
        check_device(loaded(traced(ForksABatchNorm())), Runtime(CPU), images())


class FunctionalModes(Normed):
    """Calls batch norm and dropout as functions with `training=self.training`: `torch.fx.symbolic_trace` writes
    the mode it traced in as a constant (a module given to the Python API may be such a GraphModule)."""

    def __init__(self):
        super().__init__(nn.BatchNorm2d(8))

    def forward(self, x):
        norm = self.norm
        x = torch.nn.functional.batch_norm(self.conv(x), norm.running_mean, norm.running_var, norm.weight, norm.bias,
                                           training=self.training)
        return self.head(torch.nn.functional.dropout(torch.relu(x).mean(dim=(2, 3)), 0.5, training=self.training))


def test_a_symbolically_traced_module_in_training_mode_is_refused():
    with pytest.raises(UserError, match=EVAL_ADVICE) as info:
        check_device(loaded(torch.fx.symbolic_trace(FunctionalModes().train())), Runtime(CPU), images())
    assert "batch_norm" in str(info.value) and "dropout" in str(info.value)
    assert check_device(loaded(torch.fx.symbolic_trace(FunctionalModes().eval())), Runtime(CPU), images()).verified


# ----------------------------------------------------------------------------------------------------------
# What no graph shows: the comparison at the run's batch shape

class BatchStatisticsByHand(nn.Module):
    """Subtracts the batch's mean of its features, in its own code: in eval mode too."""

    def __init__(self):
        super().__init__()
        self.inner = TinyCNN(9, seed=1)

    def forward(self, x):
        features = torch.relu(self.inner.conv(x)).mean(dim=(2, 3))
        return self.inner.fc(features - features.mean(dim=0, keepdim=True))


class RandomByHand(nn.Module):
    """Drops features at random, in its own code: in eval mode too."""

    def __init__(self):
        super().__init__()
        self.inner = TinyCNN(9, seed=1)

    def forward(self, x):
        features = torch.relu(self.inner.conv(x)).mean(dim=(2, 3))
        return self.inner.fc(features * (torch.rand_like(features) > 0.5))


class NoRunningStatistics(Normed):
    """A BatchNorm that keeps no running statistics normalises by the batch's in eval mode too: eval() cannot help."""

    def __init__(self):
        super().__init__(nn.BatchNorm2d(8, track_running_stats=False))


BY_HAND = {
    "batch statistics": (BatchStatisticsByHand, "change with the other images in its batch"),
    "no running statistics": (NoRunningStatistics, "change with the other images in its batch"),
    "random": (RandomByHand, "differ between two passes over the same batch"),
}


@pytest.mark.parametrize("kind", BY_HAND)
@pytest.mark.parametrize("batch_size", [16, 5])
def test_batch_dependence_no_graph_shows_is_found_by_the_comparison_and_named(kind, batch_size):
    make, finding = BY_HAND[kind]
    for model in (make(), traced(make().eval())):
        with pytest.raises(UserError, match=finding) as info:
            check_device(loaded(model), Runtime(CPU), images(), batch_size=batch_size)
        assert "precision" not in str(info.value) and "--allow-inexact-device" in str(info.value)
        check = check_device(loaded(model), Runtime(CPU), images(), batch_size=batch_size, allow_inexact=True)
        assert check.verified is False and finding in check.batch_dependence
        record = check.describe()
        assert record["batch_size"] == batch_size and record["batch_dependence"] == check.batch_dependence


class LastBits(nn.Module):
    """Logits that move in their last bits from pass to pass (as sums in another order do: a GPU's atomic additions,
    a backend without a determinism switch), never by more."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        logits = self.inner(x)
        return logits * (1 + 2 ** -23 * torch.randint_like(logits, -2, 3))


def test_logits_unrepeatable_in_their_last_bits_are_compared_within_the_tolerance():
    """Not repeatable bit for bit is not randomness: an honest model on such a device passes (said in the record);
    batch statistics beside last bits are still found."""
    check = check_device(loaded(LastBits(TinyCNN(9, seed=1))), Runtime(CPU), images())
    assert check.verified and check.repeatable is False and check.describe()["repeatable"] is False
    with pytest.raises(UserError, match="change with the other images in its batch"):
        check_device(loaded(LastBits(BatchStatisticsByHand())), Runtime(CPU), images())
    assert "repeatable" not in check_device(loaded(TinyCNN(9, seed=1)), Runtime(CPU), images()).describe()


def test_one_image_alone_is_a_batch_of_copies_of_it():
    """At a batch size of 1 no image shares a batch: batch statistics cannot reach another image's logits."""
    check = check_device(loaded(BatchStatisticsByHand()), Runtime(CPU), images(1), batch_size=1)
    assert check.batch_dependence is None


def tiny_resnet() -> nn.Module:
    torch.manual_seed(0)
    model = torchvision.models.resnet.ResNet(torchvision.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=9)
    for module in model.modules():  # running statistics of their own, as a trained model has
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
    return model.eval()


def tiny_vit() -> nn.Module:
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(SIZE, 8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                                                num_classes=9).eval()


HONEST = {"resnet": tiny_resnet, "vit": tiny_vit}


@pytest.mark.parametrize("name", HONEST)
@pytest.mark.parametrize("form", ["eager", "traced", "exported"])
@pytest.mark.slow
def test_honest_models_pass_at_every_batch_size_and_memory_format(name, form):
    model = loaded({"eager": lambda m: m, **FORMATS}[form](HONEST[name]()))  # (decomposed: as exported)
    for batch_size in (16, 5, 1):
        for channels_last in (False, True):
            check = check_device(model, Runtime(CPU, channels_last=channels_last), images(), batch_size=batch_size)
            assert check.verified and check.batch_dependence is None, (batch_size, channels_last, check)


def test_exported_attention_the_exact_kernels_cannot_run_is_refused_at_load(tmp_path):
    """A ViT exported with torch's default attention kernel: torch 2.6 lays the program's attention out as its fused
    CPU kernel lays it (the `.contiguous()` after it dropped), so the program fails in the math kernel that the
    exact mode runs; before, it passed the loader's probe and ended the device check in a view error's traceback.
    Where torch's program runs in the math kernel, it loads and passes; where not, it is refused when loaded, in
    one line that says how to export it."""
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(IMAGE_SIZE, 32, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                                               num_classes=9).eval()
    program = torch.export.export(vit, (torch.rand(4, 3, IMAGE_SIZE, IMAGE_SIZE),), dynamic_shapes=({0: BATCH},))
    torch.export.save(program, str(tmp_path / "vit.pt2"))
    try:  # torch's own program, run in the math kernel as the exact mode runs it
        with torch.inference_mode(), sdpa_kernel([SDPBackend.MATH]):
            program.module()(torch.rand(3, 3, IMAGE_SIZE, IMAGE_SIZE))
        runs = True
    except RuntimeError:
        runs = False
    spec = f"file:{tmp_path / 'vit.pt2'}"
    if runs:
        check = check_device(load_model(spec), Runtime(CPU), images(size=IMAGE_SIZE), batch_size=4)
        assert check.verified
        return
    with pytest.raises(UserError, match="sdpa_kernel") as refused:
        load_model(spec)
    assert "\n" not in str(refused.value) and "exact" in str(refused.value)


def test_an_exported_attention_failing_for_another_reason_is_not_blamed_on_the_kernel(tmp_path):
    """The exact kernels' hint is given only where the program runs outside them: a ViT exported for 64x64 images
    fails on the probe's 224x224 input in every kernel, and the line names that failure, not the attention kernel
    (before, any failure of a program holding attention was said to be torch 2.6's attention layout)."""
    torch.manual_seed(0)
    vit = torchvision.models.VisionTransformer(64, 32, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
                                               num_classes=9).eval()
    with sdpa_kernel([SDPBackend.MATH]):
        program = torch.export.export(vit, (torch.rand(4, 3, 64, 64),), dynamic_shapes=({0: BATCH},))
    torch.export.save(program, str(tmp_path / "vit64.pt2"))
    with pytest.raises(UserError) as refused:
        load_model(f"file:{tmp_path / 'vit64.pt2'}")
    assert "sdpa_kernel" not in str(refused.value) and "fails on a 3x3x224x224 input" in str(refused.value)


# ----------------------------------------------------------------------------------------------------------
# The scripts

def test_in9_eval_refuses_a_program_traced_in_training_mode_in_one_line(dataset, tmp_path, capsys):
    """The issue's case: such a program gave 11.11%, 16.67% and 19.44% at batch sizes 16, 7 and 5, and passed."""
    path = tmp_path / "train_mode.ts"
    torch.jit.save(traced(Normed(nn.BatchNorm2d(8)).train(), size=224), str(path))
    argv = ["--data-path", str(dataset.root), "--checkpoint", str(path), "--trust-checkpoint", "--device", "cpu",
            "--no-progress",
            "--results-file", str(tmp_path / "results.json"), "--output-dir", str(tmp_path), "--log-level", "WARNING"]
    for batch_size in ("16", "7", "5"):
        line = check_error(*run_in_process(in9_eval.main, [*argv, "--batch-size", batch_size], capsys))
        assert "training mode" in line and "model.eval()" in line and "batch_norm" in line
    assert not (tmp_path / "results.json").exists()
    code, _, err = run_in_process(in9_eval.main, [*argv, "--allow-inexact-device"], capsys)
    assert code == 0, err
    provenance = json.loads((tmp_path / "results.json").read_text())["provenance"]
    assert provenance["exact"] is False and provenance["device_check"]["verified"] is False
    assert provenance["device_check"]["training_mode"]
