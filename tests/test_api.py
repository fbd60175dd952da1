"""tools.benchmark (the Python API) on generated data: the numbers and files of in9_eval.py and challenge_eval.py
for the same model, given as a module or by name; nothing left changed after the call (math flags, the module's
modes and tensors, autocast, grad mode, logging, random state); bad input as one UserError."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import warnings

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


def strided(stride: int) -> nn.Module:
    """A 9-class convolution of stride `stride`: the same weights and classes at every stride, other logits."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 9, 8, stride=stride), nn.AdaptiveAvgPool2d(1), nn.Flatten()).eval()


def test_a_modules_configuration_is_in_its_identity(dataset, tmp_path, one_thread):
    """Two modules of the same classes, code and weights that are built differently (a convolution's stride: an
    attribute, in no state dict) compute other logits: the second is not served the first's numbers on resume."""
    model, other = strided(1), strided(4)
    assert torch.equal(model[0].weight, other[0].weight)
    x = torch.rand(1, 3, 32, 32)
    assert not torch.allclose(model(x), other(x))
    run = {"num_classes": 9, "mean": None, "challenge": False, "variations": ["original"],
           "output_dir": tmp_path / "out", **quick()}
    benchmark(model, dataset.root, **run)
    with pytest.raises(UserError, match="another model"):
        benchmark(other, dataset.root, resume=True, **run)


@dataclasses.dataclass
class HeadSettings:
    """A configuration object a module keeps and reads in its forward pass, as many do (a dataclass, a
    transformers config)."""

    sign: float = 1.0


@dataclasses.dataclass(slots=True)
class SlottedSettings:
    """HeadSettings with `__slots__` (dataclass(slots=True)): no `__dict__`."""

    sign: float = 1.0


class SlotsSettings:
    """A plain class with `__slots__`, as settings classes written for memory are."""

    __slots__ = ("sign",)

    def __init__(self, sign: float = 1.0):
        self.sign = sign


class Configured(nn.Module):
    """Logits scaled by its configuration's `sign`: the same code and weights, the other sign, the other argmax."""

    def __init__(self, settings):
        super().__init__()
        torch.manual_seed(0)
        self.settings, self.conv = settings, nn.Conv2d(3, 9, 8, stride=8)

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3)) * self.settings.sign


@pytest.mark.parametrize("kind", ["dataclass", "namespace", "slotted dataclass", "slots", "notebook's class"])
def test_a_configuration_object_a_module_reads_is_in_its_identity(kind, dataset, tmp_path, one_thread, monkeypatch):
    """A module whose forward pass reads an object it holds (its `settings`) is another model when that object says
    otherwise, though code and weights are the same: its run is not served the first one's numbers. Before, only
    plain values, tensors and lists of them were in the configuration: an object was left out whole."""
    import types  # noqa: PLC0415
    make = {"dataclass": HeadSettings, "namespace": types.SimpleNamespace, "slotted dataclass": SlottedSettings,
            "slots": SlotsSettings,
            "notebook's class": lambda sign: notebook_cell(NOTEBOOK_KEPT.format(sign=1.0), 3, monkeypatch).Settings(
                sign)}[kind]
    model = Configured(make(sign=1.0)).eval()
    run = {"num_classes": 9, "mean": None, "challenge": False, "variations": ["original"],
           "output_dir": tmp_path / "out", **quick()}
    first = benchmark(model, dataset.root, **run)
    model.settings.sign = -1.0  # the same module, reconfigured between two calls
    with pytest.raises(UserError, match="another model"):
        benchmark(model, dataset.root, resume=True, **run)
    negated = benchmark(model, dataset.root, **run)
    assert negated.accuracy != first.accuracy
    assert benchmark(Configured(make(sign=-1.0)).eval(), dataset.root, resume=True, **run).accuracy == \
        negated.accuracy  # the same module built again: the same model, resumed


def scaled_by(scale: float):
    """A forward hook multiplying a layer's output by `scale` (its closure's value)."""
    def hook(module, args, output):
        return output * scale
    return hook


def times(scale: float):
    """x * scale, `scale` in the closure."""
    return lambda x: x * scale


def activated(activation) -> nn.Module:
    """A 9-class module whose forward pass ends in the function it keeps as an attribute, `activation`."""

    class Activated(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv, self.activation = nn.Conv2d(3, 9, 8, stride=8), activation

        def forward(self, x):
            return self.activation(self.conv(x).mean(dim=(2, 3)))

    return Activated().eval()


def two_hooks(first: float, second: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 9, 8, stride=8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Identity()).eval()
    model[0].register_forward_hook(scaled_by(first))
    model[3].register_forward_hook(scaled_by(second))
    return model


def times_by_default(scale: float):
    """x * scale, `scale` bound as a default argument (no closure)."""
    return lambda x, scale=scale: x * scale


class Scaler:
    """A plain object whose method scales by its attribute."""

    def __init__(self, scale: float):
        self.scale = scale

    def apply(self, x):
        return x * self.scale


def negated_at(*positions: int) -> nn.Module:
    """A convolution, ReLU and pooling, with one negating hook (of the same code and closure) registered on each of
    the layers at `positions`: the hook's place and count change the output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 9, 8, stride=8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Identity()).eval()
    for position in positions:
        model[position].register_forward_hook(scaled_by(-1.0))
    return model


UNIT_SCALE = np.float32(1.0)


class Kept(nn.Module):
    """Logits scaled by a numpy scalar, the classes of a set (or a slice) pushed down: values a module keeps."""

    def __init__(self, scale=UNIT_SCALE, suppressed=frozenset(), kept=slice(None)):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.scale, self.suppressed, self.kept = nn.Conv2d(3, 9, 8, stride=8), scale, suppressed, kept

    def forward(self, x):
        logits = self.conv(x).mean(dim=(2, 3)) * float(self.scale)
        down = torch.full_like(logits, -100.0)
        down[:, self.kept] = 0.0
        suppressed = torch.tensor(sorted(self.suppressed), dtype=torch.long)
        return logits + down - 100.0 * torch.isin(torch.arange(9), suppressed)


class Quantised(nn.Module):
    """Logits offset by a buffer of 8-bit integers: the same bytes as int8 or uint8 are other numbers."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 9, 8, stride=8)
        self.register_buffer("offset", torch.tensor([-100, 100, -50, 50, 0, -1, 1, -127, 127],
                                                    dtype=torch.int8).view(dtype))

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3)) + self.offset.float()


@pytest.mark.parametrize("change", ["function", "partial", "closure", "second hook", "default argument",
                                    "bound method", "hook's place", "hook twice", "buffer's dtype", "numpy scalar",
                                    "set", "slice", "quantised buffer's scale", "private value"])
def test_the_functions_a_module_keeps_and_its_hooks_closures_are_in_its_identity(change, dataset, tmp_path, one_thread):
    """A function a module keeps as an attribute and calls (`self.activation = F.relu`, a partial, a closure, a
    default argument's value, a method of an object with its attributes) is part of the model: another one is another
    model, not served the first one's numbers; two hooks made by one factory with other values are both recorded
    (before, their closures' values collided: a RuntimeError out of benchmark()); a hook's place and count are the
    model's too, and so are its tensors' dtypes (before: the same identity for each pair but the first four)."""
    import functools  # noqa: PLC0415

    import torch.nn.functional as F  # noqa: PLC0415
    models = {"function": (lambda: activated(F.relu), lambda: activated(F.gelu)),
              "partial": (lambda: activated(functools.partial(F.leaky_relu, negative_slope=0.5)),
                          lambda: activated(functools.partial(F.leaky_relu, negative_slope=-2.0))),
              "closure": (lambda: activated(times(1.0)), lambda: activated(times(-1.0))),
              "second hook": (lambda: two_hooks(2.0, 1.0), lambda: two_hooks(2.0, -1.0)),
              "default argument": (lambda: activated(times_by_default(1.0)),
                                   lambda: activated(times_by_default(-1.0))),
              "bound method": (lambda: activated(Scaler(1.0).apply), lambda: activated(Scaler(-1.0).apply)),
              "hook's place": (lambda: negated_at(0), lambda: negated_at(4)),
              "hook twice": (lambda: negated_at(0), lambda: negated_at(0, 0)),
              "buffer's dtype": (lambda: Quantised(torch.int8).eval(), lambda: Quantised(torch.uint8).eval()),
              "numpy scalar": (lambda: Kept(scale=np.float32(1.0)).eval(),
                               lambda: Kept(scale=np.float32(-1.0)).eval()),
              "set": (lambda: Kept(suppressed={0, 1}).eval(), lambda: Kept(suppressed={0, 2}).eval()),
              "slice": (lambda: Kept(kept=slice(0, 9)).eval(), lambda: Kept(kept=slice(0, 5)).eval()),
              "quantised buffer's scale": (lambda: QuantisedScale(1.0).eval(), lambda: QuantisedScale(2.0).eval()),
              "private value": (lambda: PrivatelySigned(1.0).eval(), lambda: PrivatelySigned(-1.0).eval())}[change]
    x = torch.rand(2, 3, 16, 16)
    assert not torch.equal(models[0]()(x), models[1]()(x))  # two models indeed
    run = {"num_classes": 9, "mean": None, "challenge": False, "variations": ["original"],
           "output_dir": tmp_path / "out", **quick()}
    benchmark(models[0](), dataset.root, **run)
    with pytest.raises(UserError, match="another model"):
        benchmark(models[1](), dataset.root, resume=True, **run)
    benchmark(models[0](), dataset.root, resume=True, **run)  # the same model built again: resumed


class QuantisedScale(nn.Module):
    """Logits offset by a quantised buffer: the same integers at another scale are other numbers."""

    def __init__(self, scale: float):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 9, 8, stride=8)
        self.register_buffer("offset", torch.quantize_per_tensor(torch.arange(-4.0, 5.0) * scale, scale, 0,
                                                                 torch.qint8))

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3)) + 10.0 * self.offset.dequantize()


class PrivatelySigned(nn.Module):
    """Logits scaled by a private attribute, as library modules keep flags (timm's LayerNorm its `_fast_norm`)."""

    def __init__(self, sign: float):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self._sign = nn.Conv2d(3, 9, 8, stride=8), sign

    def forward(self, x):
        return self.conv(x).mean(dim=(2, 3)) * self._sign


def tiny_vision_transformer() -> nn.Module:
    """torchvision's ViT, small: its blocks keep their norm layer as partial(nn.LayerNorm, eps=1e-6)."""
    import torchvision  # noqa: PLC0415
    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(image_size=224, patch_size=112, num_layers=1, num_heads=1,
                                                hidden_dim=8, mlp_dim=8, num_classes=9).eval()


def dynamically_quantised() -> nn.Module:
    """A module quantised by torch (its linear layer's state: a dtype and packed parameters, no tensor)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 8, stride=8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 9))
    with warnings.catch_warnings():  # torch's eager quantisation is deprecated, yet users' models use it
        warnings.simplefilter("ignore")
        return torch.ao.quantization.quantize_dynamic(model.eval(), {nn.Linear}, dtype=torch.qint8)


def holding_a_cycle() -> nn.Module:
    """A module keeping a list that holds itself and a mapping that holds itself (a graph of its own)."""
    model = strided(8)
    model.kept_list, model.kept_map = [1], {"a": 1}
    model.kept_list.append(model.kept_list)
    model.kept_map["self"] = model.kept_map
    return model


@pytest.mark.parametrize("make", [tiny_vision_transformer, dynamically_quantised, holding_a_cycle])
def test_modules_as_libraries_build_them_are_evaluated_and_resumed(make, dataset, tmp_path, one_thread):
    """Modules as torchvision and torch build them, and one holding cyclic data, have an identity: evaluated, and
    resumed when built again (before: a TypeError traceback for a partial of a class, an AttributeError for a
    quantised module's state, a RecursionError for a cycle)."""
    run = {"num_classes": 9, "mean": None, "challenge": False, "variations": ["original"],
           "output_dir": tmp_path / "out", **quick()}
    if make is dynamically_quantised:  # its quantised kernels have no float64 form to check them against
        run["allow_inexact_device"] = True
    first = benchmark(make(), dataset.root, **run)
    assert benchmark(make(), dataset.root, resume=True, **run).accuracy == first.accuracy


class TransformersLogits(nn.Module):
    """A small transformers ViT, its logits out, at the attention implementation `attention` (transformers keeps it in
    its config's private `_attn_implementation_internal`)."""

    def __init__(self, attention: str):
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification  # noqa: PLC0415
        config = ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
                           image_size=224, patch_size=112, num_labels=9)
        torch.manual_seed(0)
        self.vit = ViTForImageClassification(config).eval()
        self.vit.set_attn_implementation(attention)

    def forward(self, x):
        return self.vit(pixel_values=x).logits


def test_a_transformers_models_attention_implementation_is_in_its_identity(dataset, tmp_path, one_thread):
    """A transformers model given as a module with eager attention, then with sdpa (other arithmetic: other last
    bits), is another model: not served the first one's numbers (before: one identity, the choice being a private
    attribute of its config)."""
    pytest.importorskip("transformers")
    run = {"num_classes": 9, "mean": None, "challenge": False, "variations": ["original"],
           "output_dir": tmp_path / "out", **quick()}
    benchmark(TransformersLogits("eager"), dataset.root, **run)
    with pytest.raises(UserError, match="another model"):
        benchmark(TransformersLogits("sdpa"), dataset.root, resume=True, **run)
    benchmark(TransformersLogits("eager"), dataset.root, resume=True, **run)


KEPT_OBJECT = """
class Flip:
    def __call__(self, x):
        return x * {sign}
"""


def test_the_code_of_an_object_a_module_keeps_and_calls_is_in_its_identity(dataset, tmp_path, one_thread,
                                                                           monkeypatch):
    """A callable object a module keeps (`self.activation = Flip()`), its class in a file of the user's own: that
    file edited is another model, not served the first one's numbers (its attributes were recorded, never its
    code)."""
    import importlib  # noqa: PLC0415
    import sys  # noqa: PLC0415
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "kept_object.py").write_text(KEPT_OBJECT.format(sign="1.0"))
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "kept_object", raising=False)
    module = importlib.import_module("kept_object")
    run = {"num_classes": 9, "mean": None, "challenge": False, "variations": ["original"],
           "output_dir": tmp_path / "out", **quick()}
    first = benchmark(activated(module.Flip()), dataset.root, **run)
    (folder / "kept_object.py").write_text(KEPT_OBJECT.format(sign="-1.0"))
    module = importlib.reload(module)
    with pytest.raises(UserError, match="another model"):
        benchmark(activated(module.Flip()), dataset.root, resume=True, **run)
    assert benchmark(activated(module.Flip()), dataset.root, **run).accuracy != first.accuracy


NOTEBOOK_CELL = """
import torch
from torch import nn


def {helper}(x):
    return {body}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Conv2d(3, 9, 1)

    def forward(self, x):
        return {helper}(self.fc(x).mean(dim=(2, 3)))
"""


NOTEBOOK_KEPT = """
class Settings:
    def __init__(self, sign):
        self.sign = sign


class Flip:
    def __call__(self, x):
        return x * {sign}
"""


def notebook_cell(source: str, cell: int, monkeypatch):
    """The module a notebook runs `source` in (IPython's `__main__`: no file), the cell's source kept by
    linecache."""
    import linecache  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415
    name = f"<notebook-cell-{cell}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    notebook = types.ModuleType("notebook")  # no __file__, as a notebook's __main__
    monkeypatch.setitem(sys.modules, "notebook", notebook)
    exec(compile(source, name, "exec"), notebook.__dict__)  # noqa: S102 (the test's own code)
    return notebook


def test_the_code_of_an_object_of_a_notebooks_class_a_module_keeps_is_in_its_identity(dataset, tmp_path, one_thread,
                                                                                     monkeypatch):
    """A callable object a module keeps, of a class a notebook cell defines (in no file): the cell edited and run
    again is another model (before, an object of a class in no file was left out, code and attributes)."""
    run = {"num_classes": 9, "mean": None, "challenge": False, "variations": ["original"],
           "output_dir": tmp_path / "out", **quick()}
    benchmark(activated(notebook_cell(NOTEBOOK_KEPT.format(sign="1.0"), 4, monkeypatch).Flip()), dataset.root, **run)
    with pytest.raises(UserError, match="another model"):
        benchmark(activated(notebook_cell(NOTEBOOK_KEPT.format(sign="-1.0"), 5, monkeypatch).Flip()), dataset.root,
                  resume=True, **run)


def notebook_net(cell: int, body: str, monkeypatch, helper: str = "finish") -> nn.Module:
    """`Net` as a notebook defines it: in a module no file holds (IPython's `__main__`), its source kept by linecache
    under the cell's name; its forward pass ends in a helper function of the same cell, `body` of `x`."""
    import linecache  # noqa: PLC0415
    import sys  # noqa: PLC0415
    import types  # noqa: PLC0415
    source = NOTEBOOK_CELL.format(helper=helper, body=body)
    name = f"<notebook-cell-{cell}>"
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    notebook = types.ModuleType("notebook")  # no __file__, as a notebook's __main__
    monkeypatch.setitem(sys.modules, "notebook", notebook)
    exec(compile(source, name, "exec"), notebook.__dict__)  # noqa: S102 (the test's own code)
    torch.manual_seed(0)
    return notebook.Net().eval()


@pytest.mark.parametrize("edited", ["forward", "helper"])
def test_the_code_of_a_notebooks_module_is_in_its_identity(dataset, tmp_path, one_thread, monkeypatch, edited):
    """A notebook's module (its class in no file): its forward pass edited, or a function it calls, is another
    model, whose run is not served the first one's numbers."""
    model = notebook_net(1, "x", monkeypatch)
    other = notebook_net(2, "-x", monkeypatch) if edited == "helper" else notebook_net(2, "-x", monkeypatch, "negate")
    other.load_state_dict(model.state_dict())
    x = torch.rand(1, 3, 8, 8)
    assert torch.equal(model(x), -other(x))
    run = {"num_classes": 9, "mean": None, "challenge": False, "variations": ["original"],
           "output_dir": tmp_path / "out", **quick()}
    benchmark(model, dataset.root, **run)
    with pytest.raises(UserError, match="another model"):
        benchmark(other, dataset.root, resume=True, **run)


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


@pytest.mark.slow
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
    in9_api, challenge_api = (json.loads((out / name).read_text())
                              for name in (IN9_RESULTS_FILE, CHALLENGE_RESULTS_FILE))
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


@pytest.mark.slow
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
    before = {name: (t, t.data_ptr(), t.stride(), t.requires_grad)
              for name, t in model.state_dict(keep_vars=True).items()}
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
    after = {name: (t, t.data_ptr(), t.stride(), t.requires_grad)
             for name, t in model.state_dict(keep_vars=True).items()}
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
    (lambda root: benchmark(42, root, **quick()), "must be an nn.Module, a torch.export program or a model name"),
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


@pytest.mark.slow
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
    before = {name: (p.grad, p.grad.data_ptr(), p.grad.stride(), p.grad.clone())
              for name, p in model.named_parameters()}
    benchmark(model, dataset.root, num_classes=9, variations=["original"], challenge=False, channels_last=True,
              **quick())
    after = {name: (p.grad, p.grad.data_ptr(), p.grad.stride(), p.grad) for name, p in model.named_parameters()}
    for name, (grad, pointer, stride, values) in before.items():
        assert after[name][:3] == (grad, pointer, stride), name
        assert torch.equal(after[name][3], values), name


def _graded_masks(root, tmp_path):
    """A copy of the dataset whose first mask holds 0 and 255: a mask the default arithmetic refuses."""
    import shutil  # noqa: PLC0415
    copy = tmp_path / "graded"
    shutil.copytree(root, copy)
    mask = sorted((copy / "fg_mask").rglob("*.npy"))[0]
    np.save(mask, np.load(mask).astype(np.uint8) * 255)
    return copy


def _recorded_small_cnn(tmp_path):
    """A train.py-style checkpoint that records its architecture (toolkit:small_cnn)."""
    from tools.models.architectures import SMALL_CNN, SmallCNN  # noqa: PLC0415
    path = tmp_path / "small.pth"
    torch.save({"arch": SMALL_CNN, "state_dict": SmallCNN(9).state_dict()}, path)
    return path


@pytest.mark.parametrize("call, words", [
    (lambda root, tmp: benchmark(TinyCNN(9, 0), root, num_classes=1000, **quick()),
     "num_classes=1000 says a 1000-class ImageNet model, but the module (TinyCNN) has 9 classes; "
     "drop num_classes=1000"),
    (lambda root, tmp: benchmark(TinyCNN(1000, 0), root, num_classes=9, **quick()), "drop num_classes=9"),
    (lambda root, tmp: benchmark(TinyCNN(9, 0), root / "missing", **quick()), "pass data_path the folder"),
    (lambda root, tmp: benchmark("toolkit:small_cnn", root, **quick()), "pass model='ARCH@file:PATH'"),
    (lambda root, tmp: benchmark("resnet18", root, num_classes=9, **quick()),
     "num_classes=9 needs model='ARCH@file:PATH'"),
    (lambda root, tmp: benchmark(f"resnet18@file:{_recorded_small_cnn(tmp)}", root, **quick()),
     "model='resnet18' contradicts checkpoint"),
    (lambda root, tmp: benchmark(f"file:{_recorded_small_cnn(tmp)}", root, checkpoint_key="weights", **quick()),
     "checkpoint_key 'weights' is not in the checkpoint"),
    (lambda root, tmp: benchmark("file:" + str(tmp / "none.pth"), root, **quick()), "does not exist; check the path"),
    (lambda root, tmp: benchmark(TinyCNN(9, 0), _graded_masks(root, tmp), variations=["original"], **quick()),
     "pass mask_arithmetic='original'"),  # raised in a decoding thread
    (lambda root, tmp: benchmark(nn.Sequential(nn.Conv2d(3, 4, 8, stride=8),
                                               nn.BatchNorm2d(4, track_running_stats=False),
                                               nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 9)),
                                 root, **quick()),
     "depend on batch_size and on which images share a batch"),  # a message the device check returns
    (lambda root, tmp: benchmark(TinyCNN(9, 0), root, output_dir=tmp / "out", resume=True, challenge=False,
                                 **quick()) and benchmark(TinyCNN(9, 1), root, output_dir=tmp / "out", resume=True,
                                                          challenge=False, **quick()),
     "rerun without resume=True or use another output_dir"),
])
@pytest.mark.slow
def test_errors_name_benchmarks_arguments_not_the_scripts_flags(dataset, tmp_path, call, words, monkeypatch):
    """The same mistakes that name flags on the command line name benchmark()'s arguments here, whichever module
    or thread raised them."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # no cached weights: nothing downloaded first
    with pytest.raises(UserError) as raised:
        call(dataset.root, tmp_path)
    assert words in str(raised.value) and "--" not in re.sub(r"`[^`]*`", "", str(raised.value)), str(raised.value)


def test_a_missing_device_names_the_device_argument(dataset):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    with pytest.raises(UserError, match=r"\(use device='cpu'\)$"):
        benchmark(TinyCNN(9, 0), dataset.root, **quick(device="cuda"))


# Modules benchmark() loads whose messages speak of other commands' runs, raised only by those commands: merging
# --shard results (tools.merge), reading a --full matrix back (the analysis), the leaderboard, the training report.
COMMANDS_OWN = {"tools.shards", "tools.results.matrix", "tools.results.analysis", "tools.results.leaderboard",
                "tools.results.html"}


def _text(node) -> str:
    """A message argument's literal text, "{}" for what is formatted into it (an option() call's words among them)."""
    import ast  # noqa: PLC0415
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else ""
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    return ""


# Modules benchmark() loads that only the command lines run: the scripts' shared flags and logging (tools.cli), a
# data folder's check (`python -m tools.data verify`).
COMMAND_LINE_ONLY = {"tools.cli", "tools.data.check"}
# Text that names flags for the command line's use alone: the flags' words (tools.api's table, the data folder's
# flag a script passes on), and the scaling flags a LoRA state dict's message names where no caller says otherwise.
FLAG_TABLES = {("tools.api", "API_WORDS"), ("tools.data.layout", "check_data_root"),
               ("tools.models.adapters", "options"), ("tools.models.device_check", "ALLOW_FLAG")}


def _message_texts(tree):
    """(line, text, where) of every string of a module that may reach a message: not a docstring, not inside
    argparse's or option()'s calls; `where`: the assignment or function it is in."""
    import ast  # noqa: PLC0415
    skipped, where = set(), {}
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):  # a docstring
            skipped.add(id(body[0].value))
        if isinstance(node, ast.Call) and (node.func.attr if isinstance(node.func, ast.Attribute) else
                                           getattr(node.func, "id", "")) in ("add_argument", "option"):
            skipped.update(id(sub) for sub in ast.walk(node))
        if isinstance(node, ast.JoinedStr):
            skipped.update(id(part) for part in node.values)
        names = ([t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else
                 [node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) else
                 [node.name] if isinstance(node, ast.FunctionDef) else [])
        for name in names:
            for sub in ast.walk(node):
                where.setdefault(id(sub), name)
    for node in ast.walk(tree):
        if id(node) not in skipped and isinstance(node, (ast.Constant, ast.JoinedStr)):
            yield node.lineno, _text(node), where.get(id(node), "")


@pytest.mark.slow
def test_every_option_a_message_names_has_api_words():
    """Every flag the library's messages name through tools.errors.option has benchmark()'s words for it, and no
    string of a module benchmark() loads, wherever a message is made of it (a message returned, a constant, a
    log line), writes a flag itself (commands to run, in backquotes, aside)."""
    import ast  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from tools.api import API_WORDS  # noqa: PLC0415
    root = Path(__file__).resolve().parents[1]
    named, written = set(), []
    loaded = subprocess.run([sys.executable, "-c", "import sys, tools.api; print(' '.join(m for m in sys.modules "
                             "if m.startswith('tools')))"], cwd=root, capture_output=True, text=True, check=True)
    for module in sorted(set(loaded.stdout.split()) - COMMANDS_OWN - COMMAND_LINE_ONLY):
        path = root / (module.replace(".", "/") + ".py")
        path = path if path.is_file() else root / module.replace(".", "/") / "__init__.py"
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            callee = "" if not isinstance(node, ast.Call) else (
                node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", ""))
            if callee == "option" and node.args and isinstance(node.args[0], ast.Constant):
                named.add(node.args[0].value)
        for line, text, where in _message_texts(tree):
            if (module, where) not in FLAG_TABLES and re.search(r"(?<![\w`-])--[a-z]", re.sub(r"`[^`]*`", "", text)):
                written.append(f"{module}:{line}: {text}")
    assert named and named <= set(API_WORDS), sorted(named - set(API_WORDS))
    assert written == [], written


def _exported(model: nn.Module):
    """The model exported in evaluation mode, for any batch size."""
    batch = torch.export.Dim("batch", min=1, max=2 ** 31 - 1)  # bounded: torch 2.6 guards the batch against maxsize
    return torch.export.export(model.eval(), (torch.zeros(2, 3, 224, 224),), dynamic_shapes=({0: batch},))


@pytest.mark.slow
def test_a_torch_export_program_and_its_module_give_what_the_module_gives(dataset, one_thread):
    """An ExportedProgram, and its .module() (whose train()/eval() raise: it runs in the mode it was exported in),
    are models like the module they were exported from: the same accuracies and verdicts; the caller's program is
    left as it was."""
    model = TinyCNN(9, seed=4)
    program = _exported(model)
    state = {name: (t, t.data_ptr()) for name, t in program.state_dict.items()}
    args = dict(num_classes=9, **quick())
    expected = benchmark(model, dataset.root, **args)
    for exported in (program, program.module()):
        result = benchmark(exported, dataset.root, **args)
        assert result.accuracy == expected.accuracy and result.challenge_accuracy == expected.challenge_accuracy
        assert result.in9["provenance"]["checkpoint_format"] == "torch.export program (Python API)"
    assert {name: (t, t.data_ptr()) for name, t in program.state_dict.items()} == state


@pytest.mark.parametrize("batch", [2, 3])
def test_a_program_exported_for_one_batch_size_is_one_user_error(dataset, batch, one_thread):
    """torch.export's default (no dynamic_shapes) fixes the batch size to the example's: such a program, or its
    .module(), fails on any other batch (an AssertionError traceback after start-up, the width probe of 2 images
    passing for a program of 2), so it is refused before the run, saying how to export it."""
    program = torch.export.export(TinyCNN(9, seed=4).eval(), (torch.zeros(batch, 3, 224, 224),))
    for exported in (program, program.module()):
        with pytest.raises(UserError, match=f"takes batches of exactly {batch} images.*dynamic batch dimension"):
            benchmark(exported, dataset.root, challenge=False, **quick())


def test_a_program_exported_for_a_range_of_batch_sizes_runs_within_it_or_is_one_user_error(dataset, one_thread):
    """A dynamic batch dimension bounded below past 2 (which export takes to mean any) fails on the device check's
    single images, and one bounded above on a larger batch: AssertionError ("Guard failed") tracebacks after
    start-up. The first is refused as a fixed batch is; the second in the API's words, naming the batch size it
    runs at, where it gives the module's numbers."""
    model = TinyCNN(9, seed=4).eval()
    program = torch.export.export(model, (torch.zeros(3, 3, 224, 224),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", min=3)},))
    for exported in (program, program.module()):
        with pytest.raises(UserError, match="takes batches of 3 or more images.*dynamic batch dimension"):
            benchmark(exported, dataset.root, challenge=False, **quick())
    program = torch.export.export(model, (torch.zeros(3, 3, 224, 224),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", max=4)},))
    expected = benchmark(model, dataset.root, challenge=False, **quick(batch_size=4)).accuracy
    for exported in (program, program.module()):
        with pytest.raises(UserError, match="takes batches of at most 4 images .*not 5; pass batch_size=4 or less"):
            benchmark(exported, dataset.root, challenge=False, **quick(batch_size=5))
        assert benchmark(exported, dataset.root, challenge=False, **quick(batch_size=4)).accuracy == expected


@pytest.mark.parametrize("make", [torch.jit.script, lambda m: torch.jit.trace(m, torch.zeros(2, 3, 224, 224))])
@pytest.mark.slow
def test_a_torchscript_module_in_memory_gives_what_the_module_gives(dataset, make, one_thread):
    """A scripted or traced module is an nn.Module: the same numbers as the module it was made from (its code's
    digest read the constants where torch 2.14 has a dict: an AttributeError before)."""
    import warnings  # noqa: PLC0415
    model = TinyCNN(9, seed=4).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript is deprecated upstream
        program = make(model)
    expected = benchmark(model, dataset.root, challenge=False, **quick())
    assert benchmark(program, dataset.root, challenge=False, **quick()).accuracy == expected.accuracy


def test_an_exported_module_whose_code_names_another_device_is_refused(dataset):
    """Export writes the device a tensor is made on into the code; .module() cannot be moved off it, while the
    program itself can (move_to_device_pass): the line says so."""

    class MakesTensors(nn.Module):
        def forward(self, x):
            return x.mean((2, 3)).repeat(1, 3) + torch.zeros(9, device=x.device)

    program = torch.export.export(MakesTensors().eval(), (torch.zeros(2, 3, 224, 224),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    from tools.api import _as_module  # noqa: PLC0415
    assert _as_module(program.module(), torch.device("cpu")) is not None
    with pytest.raises(UserError, match="names cpu, where it was exported, and cannot be moved to meta: pass the "
                                        "ExportedProgram itself"):
        _as_module(program.module(), torch.device("meta"))
