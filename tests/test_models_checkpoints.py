"""Checkpoint reading: every format the loader accepts round-trips to the same logits; strictness,
class-count inference, the normalisation rule and the pixel wrapper."""

from __future__ import annotations

import http.client
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn
from torchvision.transforms import Normalize
from torchvision.transforms.functional import to_tensor

from tests.helpers import files_read, save_torchscript, unrecorded_reads
from tools.data.hashing import sha256_file
from tools.errors import UserError
from tools.in9 import Normalization
from tools.models.boundary import PixelModel
from tools.models.sources import load_model

# The figures of the reference README, written out: the toolkit's constants are checked against these.
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IN9_MEAN, IN9_STD = (0.4717, 0.4499, 0.3837), (0.2600, 0.2516, 0.2575)
ROBUST_MEAN, ROBUST_STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)  # a robustness-library normaliser unlike both


pytestmark = pytest.mark.usefixtures("one_thread")


def resnet18(num_classes: int, seed: int = 0) -> nn.Module:
    """A random resnet18 whose batch-norm statistics are not the defaults, so a lost buffer shows."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = torchvision.models.resnet18(num_classes=num_classes)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)
    return model.eval()


@pytest.fixture(scope="module")
def net9() -> nn.Module:
    return resnet18(9)


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    """Small images: the resnets pool adaptively, and small forwards keep the tests fast."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=gen)


@pytest.fixture(scope="module")
def pixels224() -> torch.Tensor:
    """Full-size images, for a torch.export program (its spatial size is fixed when it is exported)."""
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8, generator=gen)


def expected_logits(module: nn.Module, pixels: torch.Tensor, stats) -> torch.Tensor:
    """The module on ToTensor-scaled, normalised pixels, computed here by hand."""
    x = pixels.float().div(255)
    if stats is not None:
        mean, std = (torch.tensor(s, dtype=torch.float32).view(1, 3, 1, 1) for s in stats)
        x = (x - mean) / std
    with torch.inference_mode():
        return module(x)


def logits_of(loaded, pixels: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(pixels)


def prefixed(state: dict, prefix: str) -> dict:
    return {prefix + k: v for k, v in state.items()}


def robustness_checkpoint(module: nn.Module) -> dict:
    """The robustness library's layout: AttackerModel(normalizer, model, attacker(normalizer, model))
    under DataParallel, saved with the optimizer and the epoch."""
    state = module.state_dict()
    mean, std = (torch.tensor(s).view(3, 1, 1) for s in (ROBUST_MEAN, ROBUST_STD))
    model_state = {"module.normalizer.new_mean": mean, "module.normalizer.new_std": std,
                   **prefixed(state, "module.model."),
                   "module.attacker.normalizer.new_mean": mean.clone(),
                   "module.attacker.normalizer.new_std": std.clone(),
                   **prefixed({k: v.clone() for k, v in state.items()}, "module.attacker.model.")}
    return {"model": model_state, "optimizer": {"state": {}, "param_groups": [{"lr": 0.1}]},
            "schedule": None, "epoch": 90}


STATE_DICT_LAYOUTS = {
    "plain": lambda sd: sd,
    "model": lambda sd: {"model": sd, "epoch": 3},
    "state_dict": lambda sd: {"state_dict": sd, "optimizer": {"lr": 0.1}, "arch": "resnet18"},
    "state_dict_ema": lambda sd: {"state_dict_ema": sd, "epoch": 7},
    "module.": lambda sd: prefixed(sd, "module."),
    "_orig_mod.": lambda sd: prefixed(sd, "_orig_mod."),
    "module._orig_mod.": lambda sd: prefixed(sd, "module._orig_mod."),
    "model+module.": lambda sd: {"model": prefixed(sd, "module.")},
}


@pytest.mark.parametrize("layout", list(STATE_DICT_LAYOUTS))
@pytest.mark.slow
def test_state_dict_layouts_round_trip(layout, net9, pixels, tmp_path):
    path = tmp_path / "ckpt.pth"
    torch.save(STATE_DICT_LAYOUTS[layout](net9.state_dict()), path)
    loaded = load_model("resnet18", checkpoint=path)
    assert loaded.num_classes == 9
    assert torch.equal(logits_of(loaded, pixels), expected_logits(net9, pixels, (IN9_MEAN, IN9_STD)))
    key = layout.split("+")[0]
    if key in ("model", "state_dict", "state_dict_ema"):
        assert f"key {key!r}" in loaded.checkpoint_format
    else:
        assert "the top level" in loaded.checkpoint_format


@pytest.mark.slow
def test_state_dict_key_priority_and_checkpoint_key(net9, pixels, tmp_path):
    other = resnet18(9, seed=1)
    path = tmp_path / "both.pth"
    torch.save({"state_dict_ema": other.state_dict(), "model": net9.state_dict()}, path)
    stats = (IN9_MEAN, IN9_STD)
    first = load_model("resnet18", checkpoint=path)  # `model` comes first in the fixed priority
    assert torch.equal(logits_of(first, pixels), expected_logits(net9, pixels, stats))
    chosen = load_model("resnet18", checkpoint=path, checkpoint_key="state_dict_ema")
    assert torch.equal(logits_of(chosen, pixels), expected_logits(other, pixels, stats))
    with pytest.raises(UserError, match=r"--checkpoint-key 'ema' is not in the checkpoint \(it has: "
                                        r"state_dict_ema, model\)"):
        load_model("resnet18", checkpoint=path, checkpoint_key="ema")


@pytest.mark.parametrize("normalize,stats", [
    (Normalization.AUTO, (ROBUST_MEAN, ROBUST_STD)),  # the checkpoint's normaliser wins over the rule
    (Normalization.IN9, (IN9_MEAN, IN9_STD)),  # --normalize overrides it
    (Normalization.IMAGENET, (IMAGENET_MEAN, IMAGENET_STD)),
    (Normalization.NONE, None),
])
@pytest.mark.slow
def test_robustness_library_layout(normalize, stats, net9, pixels, tmp_path):
    path = tmp_path / "robust.pt"
    torch.save(robustness_checkpoint(net9), path)
    loaded = load_model("resnet18", checkpoint=path, normalize=normalize)
    assert loaded.num_classes == 9
    assert "robustness library" in loaded.checkpoint_format
    assert torch.equal(logits_of(loaded, pixels), expected_logits(net9, pixels, stats))


def test_robustness_layout_is_known_by_its_keys_not_its_name(net9, pixels, tmp_path):
    path = tmp_path / "plain_name.pth"  # nothing in the name says robustness library
    torch.save(robustness_checkpoint(net9)["model"], path)
    loaded = load_model("resnet18", checkpoint=path)
    assert loaded.model.mean.flatten().tolist() == pytest.approx(ROBUST_MEAN)
    assert torch.equal(logits_of(loaded, pixels), expected_logits(net9, pixels, (ROBUST_MEAN, ROBUST_STD)))


def test_robustness_normaliser_under_other_names(net9, pixels, tmp_path):
    checkpoint = robustness_checkpoint(net9)
    state = checkpoint["model"]
    for key in [k for k in state if k.endswith("normalizer.new_mean") or k.endswith("normalizer.new_std")]:
        state[key.replace("new_", "")] = state.pop(key)
    path = tmp_path / "renamed.pt"
    torch.save(checkpoint, path)
    with pytest.raises(UserError, match=r"normaliser buffers are not normalizer.new_mean/new_std \(it has: "
                                        r"normalizer.mean, normalizer.std\); pass --normalize"):
        load_model("resnet18", checkpoint=path)
    loaded = load_model("resnet18", checkpoint=path, normalize=Normalization.IMAGENET)
    assert torch.equal(logits_of(loaded, pixels), expected_logits(net9, pixels, (IMAGENET_MEAN, IMAGENET_STD)))


@pytest.mark.slow
def test_a_file_spec_is_the_checkpoint_source(net9, pixels, tmp_path, caplog):
    """`--arch file:PATH` (the zoo's spelling) reads the file as `--checkpoint PATH` does."""
    path = tmp_path / "model.ts"
    save_torchscript(net9, path)
    with caplog.at_level("WARNING"):
        loaded = load_model(f"file:{path}", trust=True)
    assert (loaded.num_classes, loaded.checkpoint_format, loaded.source) == (9, "TorchScript", str(path))
    assert torch.equal(logits_of(loaded, pixels), expected_logits(net9, pixels, (IN9_MEAN, IN9_STD)))
    assert not [r for r in caplog.records if "is ignored" in r.message]


@pytest.mark.slow
def test_torchscript_round_trips(net9, pixels, tmp_path):
    path = tmp_path / "model.ts"
    save_torchscript(net9, path)
    loaded = load_model(checkpoint=path, trust=True)
    assert (loaded.num_classes, loaded.checkpoint_format, loaded.arch) == (9, "TorchScript", None)
    assert torch.equal(logits_of(loaded, pixels), expected_logits(net9, pixels, (IN9_MEAN, IN9_STD)))


@pytest.mark.slow
def test_torch_export_round_trips(net9, pixels224, tmp_path):
    path = tmp_path / "model.pt2"
    program = torch.export.export(net9, (torch.zeros(2, 3, 224, 224),),
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
    torch.export.save(program, path)
    loaded = load_model(checkpoint=path)
    assert (loaded.num_classes, loaded.checkpoint_format) == (9, "torch.export")
    assert torch.equal(logits_of(loaded, pixels224), expected_logits(net9, pixels224, (IN9_MEAN, IN9_STD)))
    # the wrapper can be put in eval mode and moved like any module (the program itself refuses eval())
    loaded.model.eval().to("cpu")


@pytest.mark.parametrize("allow", [[], ["--allow-inexact-device"]])
@pytest.mark.slow
def test_a_program_exported_for_one_batch_size_is_one_error_line(allow, dataset, net9, tmp_path, capsys):
    """torch.export without dynamic_shapes fixes the batch to the example's; a program of 3 passed the loader's probe
    of 3 images, then failed the device check's float64 reference ("pass --allow-inexact-device", which it is not
    about) and, allowed, the first batch of another size (an AssertionError traceback)."""
    import in9_eval  # noqa: PLC0415
    from tests.helpers import check_error, run_in_process  # noqa: PLC0415
    path = tmp_path / "fixed.pt2"
    torch.export.save(torch.export.export(net9, (torch.zeros(3, 3, 224, 224),)), path)
    argv = ["--data-path", dataset.root, "--checkpoint", path, "--device", "cpu", "--no-progress", "--output-dir",
            tmp_path / "out", *allow]
    line = check_error(*run_in_process(in9_eval.main, [str(a) for a in argv], capsys), lines=None)
    assert f"the torch.export program in {path} takes batches of exactly 3 images" in line
    assert "dynamic batch dimension" in line


def test_a_program_exported_for_a_range_of_batch_sizes_is_one_error_line(dataset, net9, tmp_path, capsys):
    """A batch dimension bounded above (Dim(max=4)) passed the loader's probe of 3 images, then failed the run's
    batch of 18 with an AssertionError traceback ("Guard failed: x.size()[0] <= 4"); it runs at --batch-size 4."""
    import in9_eval  # noqa: PLC0415
    from tests.helpers import check_error, run_in_process  # noqa: PLC0415
    path = tmp_path / "bounded.pt2"
    program = torch.export.export(net9, (torch.zeros(3, 3, 224, 224),),
                                  dynamic_shapes=({0: torch.export.Dim("batch", max=4)},))
    torch.export.save(program, path)
    argv = ["--data-path", dataset.root, "--checkpoint", path, "--device", "cpu", "--no-progress", "--output-dir",
            tmp_path / "out"]
    line = check_error(*run_in_process(in9_eval.main, [str(a) for a in argv], capsys), lines=None)
    assert "torch.export program takes batches of at most 4 images" in line and "--batch-size 4 or less" in line
    code, out, _ = run_in_process(in9_eval.main, [str(a) for a in argv] + ["--batch-size", "4"], capsys)
    assert code == 0 and "Accuracy on original is" in out


def test_pickled_module_needs_trust(net9, pixels, tmp_path):
    path = tmp_path / "whole_model.pth"
    torch.save(net9, path)
    with pytest.raises(UserError, match=r"blocked globals: .*torchvision\.models\.resnet\.ResNet.*"
                                        r"rerun with --trust-checkpoint") as info:
        load_model("resnet18", checkpoint=path)
    assert "\n" not in str(info.value)
    loaded = load_model("resnet18", checkpoint=path, trust=True)
    assert torch.equal(logits_of(loaded, pixels), expected_logits(net9, pixels, (IN9_MEAN, IN9_STD)))


# ----------------------------------------------------------------------------------------------------------
# Strict loading
def serve_as_torchvision_weights(model, tmp_path, monkeypatch) -> tuple[str, Path]:
    """ResNet18_Weights.IMAGENET1K_V1 pointed at a URL whose file name carries the SHA-256 prefix of `model`'s
    saved state dict, as torchvision's names carry theirs; (that URL, the file to serve)."""
    served_file = tmp_path / "served.pth"
    torch.save(model.state_dict(), served_file)
    url = f"https://download.invalid/models/resnet18-{sha256_file(served_file)[:8]}.pth"
    monkeypatch.setattr(torchvision.models.ResNet18_Weights.IMAGENET1K_V1.value, "url", url)
    return url, served_file


def test_a_wrong_file_in_the_weights_cache_is_refused(tmp_path, monkeypatch):
    """A file under torchvision's name that is not the file the name's hash says (other weights copied there by
    hand, half a download) would silently change every number: refused in one line."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    path = tmp_path / "torch_home" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    path.parent.mkdir(parents=True)
    torch.save(resnet18(1000, seed=4).state_dict(), path)
    with pytest.raises(UserError, match=r"resnet18-f37072fd\.pth is not the file .* names: its SHA-256 starts "):
        load_model("resnet18", weights="IMAGENET1K_V1")
    path.unlink()
    path.mkdir()
    with pytest.raises(UserError, match=r"is not a file; remove it"):
        load_model("resnet18", weights="IMAGENET1K_V1")


@pytest.mark.parametrize("failure", [RuntimeError('invalid hash value (expected "f37072fd", got "3c2e1a0b")'),
                                     http.client.IncompleteRead(b"partial", 1000)])
def test_a_failed_weights_download_is_one_error_line(failure, tmp_path, monkeypatch):
    """torch's own hash check (a proxy's error page served as the file) and a transfer cut short."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))

    def download(url, dst, *args, **kwargs):
        raise failure

    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    with pytest.raises(UserError, match=r"cannot download https://.*resnet18-f37072fd\.pth \(.+\); offline"):
        load_model("resnet18", weights="IMAGENET1K_V1")


@pytest.mark.slow
def test_pretrained_weights_download_once_into_torch_cache_and_print_nothing(pixels, tmp_path, monkeypatch,
                                                                            capsys, caplog):
    """torchvision weights are fetched into TORCH_HOME's hub cache, then read from there; no line of torch's own
    ("Downloading: ..." went to stderr on older torch and to stdout on newer, where it mixes with results)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    # the toolkit's own notice goes through logging, here to caplog alone (not to a handler an earlier test left)
    monkeypatch.setattr(logging.getLogger(), "handlers", [caplog.handler])
    caplog.set_level(logging.INFO, logger="tools.models.sources")
    served = resnet18(1000, seed=3)
    url, served_file = serve_as_torchvision_weights(served, tmp_path, monkeypatch)
    fetched = []

    def download(url, dst, *args, **kwargs):
        fetched.append(url)
        shutil.copyfile(served_file, dst)

    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    capsys.readouterr()
    for _ in range(2):
        with files_read() as read:
            loaded = load_model("resnet18", weights="IMAGENET1K_V1")
        assert unrecorded_reads(read, loaded.record) == []
        assert torch.equal(logits_of(loaded, pixels), expected_logits(served, pixels, (IMAGENET_MEAN, IMAGENET_STD)))
    path = tmp_path / "torch_home" / "hub" / "checkpoints" / Path(url).name
    assert fetched == [url] and path.is_file()
    assert loaded.record.describe()["files"]["weights"] == {"path": str(path), "sha256": sha256_file(path)}
    assert capsys.readouterr() == ("", "")
    assert [r.getMessage() for r in caplog.records if "download" in r.getMessage()] == [f"downloading {url} to {path}"]


def test_missing_keys_are_named(net9, tmp_path):
    state = net9.state_dict()
    del state["layer1.0.conv1.weight"], state["bn1.running_var"]
    path = tmp_path / "missing.pth"
    torch.save(state, path)
    with pytest.raises(UserError, match=r"does not fit --arch resnet18: missing keys: "
                                        r"(bn1\.running_var, layer1\.0\.conv1\.weight|"
                                        r"layer1\.0\.conv1\.weight, bn1\.running_var)$"):
        load_model("resnet18", checkpoint=path)


def test_unexpected_keys_are_named(net9, tmp_path):
    state = {**net9.state_dict(), "extra.weight": torch.zeros(3)}
    path = tmp_path / "unexpected.pth"
    torch.save(state, path)
    with pytest.raises(UserError, match=r"unexpected keys: extra\.weight$"):
        load_model("resnet18", checkpoint=path)


@pytest.mark.slow
def test_prefix_on_some_keys_only_is_not_stripped(net9, tmp_path):
    """A prefix is stripped only where every key has it; otherwise the load fails, naming the keys."""
    state = net9.state_dict()
    state = {("module." + k if k.startswith("fc.") else k): v for k, v in state.items()}
    path = tmp_path / "partial_prefix.pth"
    torch.save(state, path)
    with pytest.raises(UserError, match=r"has no classifier keys of resnet18 \(fc\.weight, fc\.bias\)"):
        load_model("resnet18", checkpoint=path)
    state = {("module." + k if k.startswith("layer4.") else k): v for k, v in net9.state_dict().items()}
    torch.save(state, path)
    with pytest.raises(UserError, match=r"missing keys: layer4\.0\.conv1\.weight.*; "
                                        r"unexpected keys: module\.layer4\.0\.conv1\.weight"):
        load_model("resnet18", checkpoint=path)


@pytest.mark.slow
def test_wrong_arch_is_named(net9, tmp_path):
    path = tmp_path / "r18.pth"
    torch.save(net9.state_dict(), path)
    with pytest.raises(UserError, match=r"does not fit --arch resnet34: missing keys: layer1\.2\."):
        load_model("resnet34", checkpoint=path)
    # same names, other shapes: named too, not a traceback from load_state_dict
    with pytest.raises(UserError, match=r"does not fit --arch resnet50: missing keys: .*; shapes that differ: "
                                        r"layer1\.0\.conv1\.weight \(64, 64, 3, 3\) \(the architecture has "
                                        r"\(64, 64, 1, 1\)\)"):
        load_model("resnet50", checkpoint=path)


# ----------------------------------------------------------------------------------------------------------
# Class count and normalisation

@pytest.mark.slow
def test_class_count_and_normalisation_rule(net9, tmp_path):
    net1000 = resnet18(1000)
    for module, count, mean, std, rule in ((net9, 9, IN9_MEAN, IN9_STD, "in9"),
                                           (net1000, 1000, IMAGENET_MEAN, IMAGENET_STD, "imagenet")):
        path = tmp_path / f"r18_{count}.pth"
        torch.save(module.state_dict(), path)
        loaded = load_model("resnet18", checkpoint=path)
        assert loaded.num_classes == count
        assert loaded.normalization.startswith(rule)
        assert torch.equal(loaded.model.mean, torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1))
        assert torch.equal(loaded.model.std, torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1))
    assert load_model("resnet18", checkpoint=tmp_path / "r18_9.pth", in9=True).num_classes == 9


def test_pixel_model_matches_to_tensor_and_normalize(dataset):
    paths = sorted(dataset.root.glob("original/val/*/*.JPEG"))[:6]
    images = [Image.open(p).convert("RGB") for p in paths]
    for mean, std in ((IN9_MEAN, IN9_STD), (IMAGENET_MEAN, IMAGENET_STD)):
        expected = torch.stack([Normalize(mean, std)(to_tensor(img)) for img in images])
        batch = torch.from_numpy(np.stack([np.asarray(img) for img in images])).permute(0, 3, 1, 2)
        wrapper = PixelModel(nn.Identity(), mean, std).eval()
        assert torch.equal(wrapper(batch), expected)
        assert torch.equal(wrapper(batch.contiguous()), expected)
        assert torch.equal(wrapper(batch.float().div(255)), expected)  # [0,1] floats are taken as they are
    assert torch.equal(PixelModel(nn.Identity())(batch), batch.float().div(255))  # no normalisation


def test_a_registered_source_runs_in9_eval(dataset, tmp_path, capsys):
    """A source is one function and one registration; its own statistics go inside the model."""
    import in9_eval  # noqa: PLC0415
    from tests.helpers import run_in_process  # noqa: PLC0415
    from tools.data import synthetic  # noqa: PLC0415
    from tools.in9.evaluate import evaluate_variations, list_in9_files  # noqa: PLC0415
    from tools.models.boundary import ModelOrigin, wrap  # noqa: PLC0415
    from tools.models.record import ModelRecord  # noqa: PLC0415
    from tools.models.sources import SOURCES, register_source  # noqa: PLC0415
    from tools.runtime import Runtime  # noqa: PLC0415

    stats = ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    built = []

    @register_source("toy:")
    def toy(name, options, record):
        built.append(name)
        return wrap(synthetic.ColorEvidenceModel(9), num_classes=9, normalize=options.normalize, stats=stats,
                    stats_origin="toy statistics", origin=ModelOrigin(f"toy:{name}", checkpoint_format="toy source"),
                    record=record)

    try:
        argv = ["--data-path", str(dataset.root), "--arch", "toy:colour", "--device", "cpu", "--eval-dataset",
                "mixed_rand", "--output-dir", str(tmp_path / "o"), "--results-file", str(tmp_path / "r.json"),
                "--no-progress", "--log-level", "WARNING"]
        code, out, err = run_in_process(in9_eval.main, argv, capsys)
    finally:
        SOURCES.pop("toy:")
    assert code == 0, err
    assert built == ["colour"]
    same_model = wrap(synthetic.ColorEvidenceModel(9), num_classes=9, normalize=Normalization.AUTO, stats=stats,
                      stats_origin="toy statistics", origin=ModelOrigin(None, checkpoint_format="toy"),
                      record=ModelRecord())
    expected, _ = evaluate_variations(same_model, Runtime(torch.device("cpu")),
                                      list_in9_files(dataset.root, ["mixed_rand"], 1), 16, 1, progress=False)
    assert out.splitlines()[0] == f"Accuracy on mixed_rand is {expected['mixed_rand'].accuracy:.2f}%"
    import json  # noqa: PLC0415
    provenance = json.loads((tmp_path / "r.json").read_text())["provenance"]
    assert provenance["arch"] == "toy:colour" and provenance["normalization"].startswith("toy statistics (mean [0.5")
    # a source that records nothing itself: its name, the options and the normalisation are its identity
    settings = provenance["model_record"]["settings"]
    assert settings["arch"] == "toy:colour" and settings["normalization"]["mean"] == [0.5] * 3
    assert len(provenance["identity"]) == 64


@pytest.mark.parametrize("model", ["hf:org/vit", "clip:ViT-B-32/openai"])
@pytest.mark.slow
def test_a_checkpoint_file_for_a_model_with_its_own_weights_is_one_refusal(model, tmp_path):
    """`MODEL@file:CKPT` and `--arch MODEL --checkpoint CKPT` mean one thing: for an hf: or clip: model, whose
    weights come from its own folder or repository, both are refused with the same line (the file would load as
    another architecture under the MODEL label)."""
    path = tmp_path / "weights.pt"
    torch.save(resnet18(9, seed=1).state_dict(), path)
    with pytest.raises(UserError) as named:
        load_model(f"{model}@file:{path}")
    with pytest.raises(UserError) as given:
        load_model(model, checkpoint=path)
    assert str(named.value) == str(given.value) and model in str(named.value) and "checkpoint" in str(named.value)


@pytest.mark.parametrize("arch", ["timm:resnet18", None])
@pytest.mark.slow
def test_a_timm_training_checkpoint_loads_as_the_timm_model_it_records(arch, tmp_path):
    """timm's train.py saves {'epoch', 'arch': its --model (a bare timm name), 'state_dict', 'optimizer',
    'version', 'args'}: that name is a timm architecture (not torchvision's resnet18), named or not."""
    import argparse  # noqa: PLC0415
    timm = pytest.importorskip("timm")
    torch.manual_seed(2)
    module = timm.create_model("resnet18", num_classes=9).eval()
    path = tmp_path / "model_best.pth.tar"
    torch.save({"epoch": 3, "arch": "resnet18", "state_dict": module.state_dict(), "optimizer": {}, "version": 2,
                "args": argparse.Namespace(model="resnet18", num_classes=9)}, path)
    loaded = load_model(arch, checkpoint=path, trust=True)
    assert loaded.arch == "timm:resnet18" and loaded.num_classes == 9
    batch = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(loaded.model.classifier(batch), module(batch))
