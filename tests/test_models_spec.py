"""One grammar for model names (`tools.models.spec.ModelSpec`), used by both scripts, train.py and the zoo; the
registries of sources and architectures list themselves."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

import challenge_eval
import in9_eval
from tests.helpers import run_in_process
from tools import zoo
from tools.errors import UserError
from tools.models import list_sources
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.models.sources import load_model
from tools.models.spec import ModelSpec
from tools.training.config import TrainConfig
from tools.training.loop import starting_point


@pytest.mark.parametrize("text, fields", [
    ("resnet50", ("", "resnet50", None, None)),
    ("timm:convnext_tiny", ("timm:", "convnext_tiny", None, None)),
    ("timm:vit_base_patch16_224.augreg_in21k_ft_in1k", ("timm:", "vit_base_patch16_224", "augreg_in21k_ft_in1k", None)),
    ("clip:ViT-B-32/openai", ("clip:", "ViT-B-32", "openai", None)),
    ("clip:ViT-B-32//data/a.b.pt+head=in9", ("clip:", "ViT-B-32", "/data/a.b.pt+head=in9", None)),
    ("file:dir/my.pt", ("", "", None, "dir/my.pt")),
    ("file:a@b.pt", ("", "", None, "a@b.pt")),
    ("resnet18@file:dir/sd.pt", ("", "resnet18", None, "dir/sd.pt")),
    ("timm:vit_tiny_patch16_224.augreg_in21k@file:a@b.pt", ("timm:", "vit_tiny_patch16_224", "augreg_in21k", "a@b.pt")),
    ("toolkit:small_cnn", ("toolkit:", "small_cnn", None, None)),
    ("hf:/data/runs/vit@ep10", ("hf:", "/data/runs/vit@ep10", None, None)),
    ("hf:org/name@rev", ("hf:", "org/name@rev", None, None)),
    ("timm:hf-hub:org/name@rev", ("timm:", "hf-hub:org/name@rev", None, None)),
    ("clip:ViT-B-32//home/me/w@v2.pt", ("clip:", "ViT-B-32", "/home/me/w@v2.pt", None)),  # a weights path with @
    ("hf:/runs/vit@ep10@file:/runs/lora@ep2", ("hf:", "/runs/vit@ep10", None, "/runs/lora@ep2")),
])
def test_every_form_parses_and_round_trips(text, fields):
    spec = ModelSpec.parse(text)
    assert (spec.prefix, spec.name, spec.tag, spec.file) == fields
    assert str(spec) == text and ModelSpec.parse(str(spec)) == spec


def brute_force_text(prefix: str, name: str, tag: str | None, file: str | None) -> str:
    """The name written out by hand: PREFIX NAME [SEP TAG], then @file:PATH, or file:PATH alone."""
    separator = {"timm:": ".", "clip:": "/"}.get(prefix, "")
    model = f"{prefix}{name}" + (f"{separator}{tag}" if tag is not None else "")
    if file is None:
        return model
    return f"{model}@file:{file}" if model else f"file:{file}"


@pytest.mark.parametrize("text, fields", [
    ("resnet18@file:b@1.pt@file:ad@2", ("", "resnet18", "b@1.pt", "ad@2")),
    ("hf:org/name@rev@file:adapter", ("hf:", "org/name@rev", "adapter", None)),
    ("timm:hf-hub:org/name@rev@file:base.pt@file:adapter", ("timm:", "hf-hub:org/name@rev", "base.pt", "adapter")),
])
def test_names_with_at_keep_base_and_adapter(text, fields):
    """Only `@file:` separates a checkpoint (and an adapter after it); any other `@` belongs to the name or path."""
    spec = ModelSpec.parse(text)
    assert (spec.prefix, spec.name, spec.file, spec.adapter) == fields
    assert str(spec) == text


def test_brute_force_table_of_every_combination():
    prefixes, names = ["", "timm:", "toolkit:", "clip:", "toy:"], ["resnet18", "vit_b-16"]
    tags, files = [None, "", "fb_in1k", "x.y"], [None, "m.pt", "d/a@b.pt", "c:/w.pt"]
    checked = 0
    for prefix, name, tag, file in itertools.product(prefixes, names, tags, files):
        if tag is not None and prefix not in ("timm:", "clip:"):
            continue  # a family without tags: the "tag" would be part of the name
        text = brute_force_text(prefix, name, tag, file)
        spec = ModelSpec.parse(text)
        assert (spec.prefix, spec.name, spec.tag, spec.file) == (prefix, name, tag, file), text
        assert str(spec) == text
        checked += 1
    assert checked == 3 * 2 * 4 + 2 * 2 * 4 * 4  # tagless families x names x files, tagged ones x tags too


@pytest.mark.parametrize("text, message", [
    ("", "an empty model name"),
    ("resnet18@sd.pt", "ARCH@ must be followed by file:PATH"),
    ("@file:sd.pt", "ARCH@ must be followed by file:PATH"),
    ("resnet18@file:", "names no file after file:"),
    ("file:", "names no file after file:"),
    ("timm:", "names no architecture after 'timm:'"),
    ("timm:.fb_in1k@file:a.pt", "names no architecture after 'timm:'"),
])
def test_bad_forms_are_user_errors(text, message):
    with pytest.raises(UserError, match=message):
        ModelSpec.parse(text)


def test_the_zoo_keeps_its_fields():
    spec = zoo.parse_model_spec("  resnet18@file:~/sd.pt ")
    assert (spec.text, spec.source, spec.arch, spec.path) == ("resnet18@file:~/sd.pt", "file", "resnet18",
                                                              Path("~/sd.pt").expanduser())
    assert zoo.parse_model_spec("toolkit:small_cnn").source == "toolkit"


def test_list_sources_says_what_is_registered():
    registered = list_sources()
    assert set(registered["sources"]) >= {"", "timm:", "toolkit:", "clip:", "file:"}
    assert set(registered["architectures"]) == {"", "timm:", "toolkit:"}
    for descriptions in registered.values():
        for description in descriptions.values():
            assert description and "\n" not in description


def test_an_unknown_prefix_lists_the_registered_ones():
    with pytest.raises(UserError, match=r"unknown model source 'timn:' in 'timn:convnext_tiny'; did you mean timm:\?; "
                                             r"valid: .*timm:"):
        load_model("timn:convnext_tiny")


@pytest.fixture(scope="module")
def small_cnn_file(tmp_path_factory):
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("names") / "cnn.pt"
    torch.save(SmallCNN(9).state_dict(), path)
    return path


COMMANDS = {"in9_eval": in9_eval, "challenge_eval": challenge_eval}


def command_line(name, dataset, tmp_path, *model, capsys):
    script = COMMANDS[name]
    argv = ["--data-path", str(dataset.root), *map(str, model), "--device", "cpu", "--no-progress",
            "--log-level", "WARNING", "--output-dir", str(tmp_path / name), "--workers", "1"]
    if name == "in9_eval":
        argv += ["--eval-dataset", "mixed_rand"]
    else:
        argv += ["--no-cache", "--batch-size", "8"]
    return run_in_process(script.main, argv, capsys)


@pytest.mark.parametrize("bad", ["resnet18@sd.pt", "timm:", "timn:convnext_tiny"])
def test_every_command_rejects_the_same_bad_names(bad, dataset, tmp_path, capsys):
    with pytest.raises(UserError) as raised:
        load_model(bad)
    expected = f"error: {raised.value}"
    for name in COMMANDS:
        code, out, err = command_line(name, dataset, tmp_path, "--arch", bad, capsys=capsys)
        assert (code, err.splitlines()[-1]) == (2, expected), name
    with pytest.raises(UserError, match=re.escape(str(raised.value))):
        starting_point(TrainConfig(data_path=tmp_path, output_dir=tmp_path, arch=bad))
    with pytest.raises(UserError, match=re.escape(str(raised.value))):
        zoo.load(zoo.parse_model_spec(bad))


@pytest.mark.slow
def test_every_command_takes_arch_at_file(small_cnn_file, dataset, tmp_path, capsys):
    """`ARCH@file:PATH` is `--arch ARCH --checkpoint PATH` in both scripts, train.py and the zoo."""
    joined = f"{SMALL_CNN}@file:{small_cnn_file}"
    for name in COMMANDS:
        apart = command_line(name, dataset, tmp_path, "--arch", SMALL_CNN, "--checkpoint", small_cnn_file,
                             capsys=capsys)
        together = command_line(name, dataset, tmp_path, "--arch", joined, capsys=capsys)
        assert apart[0] == 0 and together == apart, name
    expected = torch.load(small_cnn_file, weights_only=True)
    start = starting_point(TrainConfig(data_path=tmp_path, output_dir=tmp_path, arch=joined))
    assert start.arch == SMALL_CNN
    loaded = zoo.load(zoo.parse_model_spec(joined))
    for state in (start.classifier.state_dict(), loaded.model.classifier.state_dict()):
        assert all(torch.equal(state[k], expected[k]) for k in expected) and state.keys() == expected.keys()
    with pytest.raises(UserError, match="both name a checkpoint file"):
        load_model(joined, checkpoint=small_cnn_file)


def test_timm_tags_build_the_tagged_architecture():
    from tools.models.architectures import build_architecture  # noqa: PLC0415
    pytest.importorskip("timm")
    tagged = build_architecture("timm:convnext_atto.d2_in1k", 9)  # not on meta: timm 0.9 reads tensors while building
    assert tagged.pretrained_cfg["tag"] == "d2_in1k" and tagged.num_classes == 9
    with pytest.raises(UserError, match=r"unknown timm tag 'nope' of convnext_atto \(valid: .*d2_in1k"):
        build_architecture("timm:convnext_atto.nope", 9)


def test_classifier_keys_of_an_architecture_that_cannot_be_built_on_meta(monkeypatch):
    """Some architectures read tensor values while they are built (timm 0.9's ConvNeXt: drop-path rates from
    torch.linspace(...).tolist()), which the meta device cannot give: the keys are then found by building on the CPU."""
    from tools.models import architectures  # noqa: PLC0415
    build = architectures.build_architecture

    def reads_values(arch, num_classes, arch_args=None):
        model = build(arch, num_classes, arch_args)
        torch.zeros(1).tolist()  # what such an architecture does while it is built
        return model

    monkeypatch.setattr(architectures, "build_architecture", reads_values)
    assert architectures.classifier_keys(SMALL_CNN) == ["fc.weight", "fc.bias"]
