"""torchvision weights built and fed as torchvision gives them: every classification weights' builder arguments
(a ViT's image size, Inception's input transform) are the ones torchvision's own builder takes from them; weights
files served from a TORCH_HOME cache built here load into that architecture (a SWAG ViT at 384 pixels, GoogLeNet
with its input transform, DenseNet's older key names) and are fed at the size their transforms crop to, with their
interpolation and statistics; train.py starts from such weights and its checkpoint is fed the same way."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import torch
import torchvision

from tests.helpers import run_train
from tests.test_models_hub import images, own_logits, seeded
from tools.data.hashing import sha256_file
from tools.models.architectures import build_with_weights, torchvision_architectures, torchvision_weights_arguments
from tools.models.boundary import InputResize, network_input
from tools.models.sources import load_model
from tools.training.checkpoint import CHECKPOINT_NAME

QUIET = ["--device", "cpu", "--no-progress", "--log-level", "WARNING", "--workers", "0"]


def every_weights() -> list[tuple[str, object]]:
    return [(arch, member) for arch in torchvision_architectures()
            for member in torchvision.models.get_model_weights(arch)]


def scalar_settings(model: torch.nn.Module) -> dict:
    """Every module's plain attributes (flags, sizes): what a builder argument changes besides the tensors."""
    return {name: {k: v for k, v in vars(module).items() if isinstance(v, (bool, int, float, str, tuple, list))}
            for name, module in model.named_modules()}


@contextlib.contextmanager
def weights_on_meta():
    """Modules built on the CPU with their parameters and buffers moved to the meta device as they are registered
    (and so initialised there): for builders that read tensor values (RegNet's widths), which the meta device has
    none of."""
    register_parameter, register_buffer = torch.nn.Module.register_parameter, torch.nn.Module.register_buffer

    def parameter(self, name, param):
        register_parameter(self, name, None if param is None else
                           torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))

    def buffer(self, name, tensor, persistent=True):
        register_buffer(self, name, None if tensor is None else tensor.to("meta"), persistent)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.Module, "register_parameter", parameter)
        patch.setattr(torch.nn.Module, "register_buffer", buffer)
        yield


def on_meta(build):
    try:
        with torch.device("meta"):
            return build()
    except NotImplementedError:  # "Cannot copy out of meta tensor; no data!"
        with weights_on_meta():
            return build()


@pytest.mark.slow
def test_builder_arguments_are_those_torchvisions_builder_takes_from_every_weights(monkeypatch):
    """For each classification weights: the architecture built with `torchvision_weights_arguments` is the one
    torchvision's builder makes for the weights: the same tensors, of the same shapes, and the same settings (on
    the meta device, the builder's loading of the weights' file left out: no memory, no download)."""
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", lambda self, state, *args, **kwargs: None)
    checked, seen = set(), set()
    for arch, member in every_weights():
        what_builders_read = (arch, len(member.meta["categories"] or ()), tuple(member.meta["min_size"]))
        if what_builders_read in seen:  # another file of weights the builder treats alike
            continue
        seen.add(what_builders_read)
        classes = len(member.meta["categories"] or range(1000))  # VGG16's features alone have no categories
        ours = on_meta(lambda: torchvision.models.get_model(arch, weights=None, num_classes=classes,  # noqa: B023
                                                           **torchvision_weights_arguments(member)))  # noqa: B023
        theirs = on_meta(lambda: build_with_weights(arch, member, {}))  # noqa: B023
        assert {k: v.shape for k, v in ours.state_dict().items()} == \
            {k: v.shape for k, v in theirs.state_dict().items()}, member
        assert scalar_settings(ours) == scalar_settings(theirs), member
        checked.add(type(member).__module__)
    assert {"torchvision.models.vision_transformer", "torchvision.models.googlenet"} <= checked


def serve(member, module: torch.nn.Module | dict, folder: Path, monkeypatch, legacy=None) -> Path:
    """`member` pointed at a URL whose file name carries the SHA-256 prefix of `module`'s state dict (keys renamed
    by `legacy`, as an old file names them), that file put in TORCH_HOME's hub cache as a download leaves it."""
    monkeypatch.setenv("TORCH_HOME", str(folder / "torch_home"))
    state = module.state_dict() if isinstance(module, torch.nn.Module) else module
    if legacy is not None:
        state = {legacy(key): value for key, value in state.items() if legacy(key) is not None}
    staged = folder / "staged.pth"
    torch.save(state, staged)
    url = f"https://download.invalid/models/{member.name.lower()}-{sha256_file(staged)[:8]}.pth"
    monkeypatch.setattr(member.value, "url", url)
    cached = folder / "torch_home" / "hub" / "checkpoints" / Path(url).name
    cached.parent.mkdir(parents=True, exist_ok=True)
    staged.rename(cached)
    return cached


@pytest.mark.slow
def test_swag_vit_weights_build_the_vit_at_384_pixels(tmp_path, monkeypatch):
    """--weights IMAGENET1K_SWAG_E2E_V1 on vit_b_16: the ViT built for 384x384 inputs, the images resized to that
    (bicubic, as the weights' transforms), not a state-dict traceback."""
    member = torchvision.models.ViT_B_16_Weights.IMAGENET1K_SWAG_E2E_V1
    with torch.device("meta"):
        shapes = torchvision.models.vit_b_16(image_size=384).state_dict()
    path = serve(member, {k: torch.zeros(v.shape) for k, v in shapes.items()}, tmp_path, monkeypatch)
    loaded = load_model("vit_b_16", weights="IMAGENET1K_SWAG_E2E_V1")
    network, size, mode = network_input(loaded.model.classifier)
    assert isinstance(loaded.model.classifier, InputResize) and (size, mode) == ((384, 384), "bicubic")
    assert network.image_size == 384 and loaded.source == str(path)
    assert loaded.details["arch_args"] == {"image_size": 384}
    assert loaded.record.describe()["settings"]["torchvision pipeline"]["input_size"] == [384, 384]


def densenet_legacy_key(key: str) -> str | None:
    """DenseNet's key as the published files (saved before BatchNorm counted its batches) name it: 'norm.1' (before
    '.' was refused in module names), None for a batch count."""
    if key.endswith("num_batches_tracked"):
        return None
    return re.sub(r"(denselayer\d+\.(?:norm|relu|conv))([12])\.", r"\1.\2.", key)


@pytest.mark.parametrize("arch, weights, size, mode, build", [
    ("googlenet", "IMAGENET1K_V1", 224, None,
     lambda: torchvision.models.googlenet(transform_input=True, aux_logits=True, init_weights=False)),  # as saved
    ("efficientnet_b1", "IMAGENET1K_V1", 240, "bicubic", lambda: torchvision.models.efficientnet_b1()),
    ("densenet121", "IMAGENET1K_V1", 224, None, lambda: torchvision.models.densenet121()),
])
@pytest.mark.slow
def test_weights_are_fed_as_their_transforms_say(arch, weights, size, mode, build, tmp_path, monkeypatch):
    """Logits equal the architecture torchvision's builder makes for the weights (written out by hand) on the
    images normalised with the transforms' statistics and resized to their crop size with their interpolation."""
    member = torchvision.models.get_model_weights(arch)[weights]
    module = seeded(build(), 3)
    serve(member, module, tmp_path, monkeypatch, densenet_legacy_key if arch.startswith("densenet") else None)
    loaded = load_model(arch, weights=weights)
    assert network_input(loaded.model.classifier)[1:] == ((size, size), mode)
    batch = images(1 if arch.startswith("densenet") else 2)
    transforms = member.transforms()
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(module, batch, transforms.mean, transforms.std,
                                                                   size, mode or "bicubic"), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_train_py_from_weights_of_another_size_saves_a_checkpoint_fed_at_it(tiny, tmp_path, monkeypatch, capsys,
                                                                           one_thread):
    member = torchvision.models.EfficientNet_B1_Weights.IMAGENET1K_V1
    serve(member, seeded(torchvision.models.efficientnet_b1(), 4), tmp_path, monkeypatch)
    out = tmp_path / "run"
    code, _, err = run_train(["--data-path", tiny, "--arch", "efficientnet_b1", "--weights", "IMAGENET1K_V1",
                              "--freeze", "backbone", "--epochs", 1, "--batch-size", 9, "--output-dir", out, *QUIET],
                             capsys)
    assert code == 0, err
    saved = torch.load(out / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    assert (saved["input_size"], saved["interpolation"], saved["arch_args"]) == ([240, 240], "bicubic", {})
    network = torchvision.models.efficientnet_b1(num_classes=9)
    network.load_state_dict(saved["model"])
    loaded = load_model(checkpoint=out / CHECKPOINT_NAME)
    batch = images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(network.eval(), batch, saved["mean"], saved["std"],
                                                                   240), rtol=1e-4, atol=1e-4)


def test_a_trained_checkpoint_rebuilds_its_network_with_the_builder_arguments_it_records(tmp_path):
    """GoogLeNet fine-tuned from ImageNet weights keeps their input transform: the checkpoint says so, and the
    evaluation builds it so."""
    from tools.runtime import Precision  # noqa: PLC0415
    from tools.training.checkpoint import NetworkInput, trained_checkpoint  # noqa: PLC0415
    arguments = torchvision_weights_arguments(torchvision.models.GoogLeNet_Weights.IMAGENET1K_V1)
    network = seeded(torchvision.models.googlenet(num_classes=9, **arguments), 5)
    path = tmp_path / "googlenet9.pt"
    torch.save(trained_checkpoint(network, "googlenet", [0.485, 0.456, 0.406], [0.229, 0.224, 0.225], "erm", {}, {},
                                  Precision.FP32, NetworkInput(arguments)), path)
    loaded = load_model(checkpoint=path)
    assert loaded.model.classifier.transform_input and loaded.details["arch_args"] == arguments
    batch = images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(network, batch, (0.485, 0.456, 0.406),
                                                                   (0.229, 0.224, 0.225), 224), rtol=1e-4, atol=1e-4)


def test_weights_that_are_no_classifier_are_refused_before_they_are_downloaded(tmp_path, monkeypatch, dataset,
                                                                               capsys):
    """VGG16's IMAGENET1K_FEATURES (SSD's backbone) has no categories and NaN classifier weights, which torchvision
    says cannot classify: every logit would be NaN, every prediction class 0, and an accuracy printed. One line,
    before any download, naming the weights that classify."""
    import in9_eval  # noqa: PLC0415
    from tests.helpers import check_error, run_in_process  # noqa: PLC0415
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # empty: a download would be tried first
    code, out, err = run_in_process(in9_eval.main, ["--data-path", str(dataset.root), "--arch", "vgg16", "--weights",
                                                    "IMAGENET1K_FEATURES", "--device", "cpu"], capsys)
    line = check_error(code, out, err, lines=None)
    assert "IMAGENET1K_FEATURES" in line and "no classifier" in line and "IMAGENET1K_V1" in line
    assert not (tmp_path / "torch_home").exists()


@pytest.mark.slow
def test_train_py_fine_tunes_googlenet_from_its_weights(tiny, tmp_path, monkeypatch, capsys, one_thread):
    """GoogLeNet's weights build it without its auxiliary heads (torchvision's builder drops them): its 9-class head
    is the one of that network (not of the default one, which has two more), and its checkpoint keeps the input
    transform."""
    member = torchvision.models.GoogLeNet_Weights.IMAGENET1K_V1
    serve(member, seeded(torchvision.models.googlenet(transform_input=True, aux_logits=True, init_weights=False), 6),
          tmp_path, monkeypatch)
    out = tmp_path / "run"
    code, _, err = run_train(["--data-path", tiny, "--arch", "googlenet", "--weights", "IMAGENET1K_V1", "--freeze",
                              "backbone", "--epochs", 1, "--batch-size", 6, "--output-dir", out, *QUIET], capsys)
    assert code == 0, err
    saved = torch.load(out / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    assert saved["arch_args"] == torchvision_weights_arguments(member) and saved["arch_args"]["transform_input"]
    assert load_model(checkpoint=out / CHECKPOINT_NAME).model(images(2)).shape == (2, 9)


@pytest.mark.parametrize("arch", ["googlenet", "inception_v3"])
@pytest.mark.slow
def test_networks_built_for_weights_train_on_their_logits_alone(arch):
    """In training mode a network built for its weights (and its 9-class copy) gives its logits, not a tuple with
    auxiliary heads' outputs, which the toolkit's loss does not take: torchvision's builder drops GoogLeNet's
    auxiliary heads after loading its weights, and Inception-v3's are dropped the same way; the heads the class
    count shapes are those of that network."""
    member = torchvision.models.get_model_weights(arch).IMAGENET1K_V1
    size = member.meta["min_size"][0] if arch == "googlenet" else 299
    with torch.device("meta"):
        full = torchvision.models.get_model(arch, weights=None, **{**torchvision_weights_arguments(member),
                                                                    "aux_logits": True})
    state = {key: torch.zeros(value.shape) for key, value in full.state_dict().items()}
    for network in (build_with_weights(arch, member, state),
                    torchvision.models.get_model(arch, weights=None, num_classes=9,
                                                 **torchvision_weights_arguments(member))):
        out = network.train()(torch.zeros(2, 3, max(size, 75), max(size, 75)))
        assert isinstance(out, torch.Tensor), type(out)
    from tools.models.architectures import classifier_keys  # noqa: PLC0415
    assert classifier_keys(arch, torchvision_weights_arguments(member)) == ["fc.weight", "fc.bias"]
