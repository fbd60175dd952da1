"""Models whose input is not 224x224, through train.py and the evaluation scripts: timm tags of 160 and 384 pixels
(from a Hugging Face cache built here) train the network itself, which the saved checkpoint holds and the
evaluation feeds at its size; a random initialisation of such a tag trains at its size too."""

from __future__ import annotations

import json

import pytest
import torch

import in9_eval
from tests.helpers import run_in_process, run_train
from tests.test_models_hub import images, own_logits, put_in_cache, seeded
from tools.models.sources import load_model
from tools.training.checkpoint import CHECKPOINT_NAME

QUIET = ["--device", "cpu", "--no-progress", "--log-level", "WARNING", "--workers", "0"]
TIMM_NAME = "test_vit"  # timm's tiny test ViT, whose input size is fixed when it is built
TAGGED = f"timm:{TIMM_NAME}.r160_in1k"  # a registered tag: 160x160 inputs, mean and std 0.5
HUB_384 = "bgc-test/test_vit_384"  # a hub repository whose config gives 384x384 inputs


def timm_or_skip():
    timm = pytest.importorskip("timm")
    pytest.importorskip("safetensors.torch")
    if TIMM_NAME not in timm.list_models():
        pytest.skip(f"timm {timm.__version__} has no {TIMM_NAME}")
    return timm


@pytest.fixture(scope="module")
def timm_files(tmp_path_factory):
    """{size: (the model with seeded weights, its repository, its model.safetensors and config.json)} for the
    registered 160-pixel tag and a 384-pixel hub repository."""
    timm = timm_or_skip()
    from safetensors.torch import save_file  # noqa: PLC0415
    files = {}
    for size, repo in ((160, f"timm/{TAGGED[len('timm:'):]}"), (384, HUB_384)):
        folder = tmp_path_factory.mktemp(f"timm{size}")
        module = seeded(timm.create_model(TIMM_NAME, pretrained=False, img_size=size), size)
        save_file(module.state_dict(), folder / "model.safetensors")
        cfg = {**module.pretrained_cfg, "hf_hub_id": repo, "input_size": [3, size, size]}
        (folder / "config.json").write_text(json.dumps({"architecture": TIMM_NAME, "num_classes": 1000,
                                                        "pretrained_cfg": cfg}))
        files[size] = (module, repo, {name: folder / name for name in ("model.safetensors", "config.json")})
    return files


def timm_name(size: int) -> str:
    return TAGGED if size == 160 else f"timm:hf-hub:{HUB_384}"


@pytest.mark.parametrize("size", [160, 384])
@pytest.mark.slow
def test_train_py_starts_from_a_timm_model_of_another_size_and_saves_the_network(size, timm_files, hub_cache, tiny,
                                                                                   tmp_path, capsys, one_thread):
    """From the pretrained name: a new 9-class head on the network itself, trained at the network's size (the ViT
    refuses any other), saved as the network's keys; in9_eval.py takes that checkpoint and feeds it at its size;
    train.py takes it again as a starting point, and saves the network's keys again."""
    timm = timm_or_skip()
    module, repo, files = timm_files[size]
    put_in_cache(hub_cache, repo, files)
    out = tmp_path / "run"
    code, _, err = run_train(["--data-path", tiny, "--arch", timm_name(size), "--epochs", 1, "--batch-size", 6,
                              "--output-dir", out, *QUIET], capsys)
    assert code == 0, err
    network = timm.create_model(TIMM_NAME, pretrained=False, img_size=size, num_classes=9)
    saved = torch.load(out / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    assert sorted(saved["model"]) == sorted(network.state_dict())
    assert saved["arch"] == timm_name(size) and saved["input_size"] == [size, size]
    network.load_state_dict(saved["model"])

    loaded = load_model(checkpoint=out / CHECKPOINT_NAME)
    batch = images(4)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(network.eval(), batch, (0.5,) * 3, (0.5,) * 3,
                                                                   size), rtol=1e-4, atol=1e-4)
    code, stdout, err = run_in_process(in9_eval.main, ["--data-path", str(tiny), "--checkpoint",
                                                       str(out / CHECKPOINT_NAME), "--eval-dataset", "original",
                                                       "--device", "cpu", "--no-progress", "--output-dir",
                                                       str(tmp_path / "eval")], capsys)
    assert code == 0, err
    assert stdout.startswith("Accuracy on original is ")

    again = tmp_path / "again"
    code, _, err = run_train(["--data-path", tiny, "--checkpoint", out / CHECKPOINT_NAME, "--epochs", 1,
                              "--batch-size", 6, "--output-dir", again, *QUIET], capsys)
    assert code == 0, err
    resaved = torch.load(again / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    assert sorted(resaved["model"]) == sorted(network.state_dict()) and resaved["input_size"] == [size, size]


def test_train_py_from_random_weights_of_a_tag_trains_at_its_size(timm_files, hub_cache, tiny, tmp_path, capsys,
                                                                  one_thread):
    """`--weights none` on a tag whose architecture is built for 160x160 inputs: trained and evaluated at 160."""
    timm_or_skip()
    out = tmp_path / "run"
    code, _, err = run_train(["--data-path", tiny, "--arch", TAGGED, "--weights", "none", "--epochs", 1,
                              "--batch-size", 6, "--output-dir", out, *QUIET], capsys)
    assert code == 0, err
    saved = torch.load(out / CHECKPOINT_NAME, map_location="cpu", weights_only=True)
    assert saved["input_size"] == [160, 160]
    assert load_model(checkpoint=out / CHECKPOINT_NAME).model(images(2)).shape == (2, 9)


def test_a_hub_name_with_a_checkpoint_file_takes_the_hub_configs_input(timm_files, hub_cache, tmp_path):
    """`timm:hf-hub:ORG/NAME@file:CKPT`, a plain state dict: the repository's config gives the architecture and
    the pixel pipeline (384x384, mean and std 0.5), as `timm:NAME.TAG@file:CKPT` takes the tag's."""
    module, repo, files = timm_files[384]
    put_in_cache(hub_cache, repo, files)
    path = tmp_path / "weights.pt"
    torch.save(module.state_dict(), path)
    loaded = load_model(f"timm:hf-hub:{repo}@file:{path}")
    batch = images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(module, batch, (0.5,) * 3, (0.5,) * 3, 384),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_a_state_saved_before_networks_were_fed_at_their_size_is_refused(timm_files, hub_cache, tiny, tmp_path,
                                                                         capsys, monkeypatch, one_thread):
    """Versions before the resume key held the starting model's identity fed every network 224x224 images (and
    built torchvision's without their weights' arguments): a state of theirs resumes only a run fed the same way.
    For a network fed at another size it would go on training, silently, on other inputs than it began with."""
    from tests.helpers import check_error  # noqa: PLC0415
    from tests.test_train_integrity import interrupt_at_step  # noqa: PLC0415
    from tools.training.checkpoint import STATE_NAME  # noqa: PLC0415
    module, repo, files = timm_files[160]
    put_in_cache(hub_cache, repo, files)
    common = ["--data-path", tiny, "--arch", timm_name(160), "--epochs", 2, "--batch-size", 6, "--save-every", 1,
              *QUIET]
    out = tmp_path / "run"
    interrupt_at_step(2, [*common, "--output-dir", out], capsys, monkeypatch)
    state = torch.load(out / STATE_NAME, weights_only=True)
    del state["run_key"]["start"]  # as a version before wrote it
    torch.save(state, out / STATE_NAME)
    code, stdout, err = run_train([*common, "--output-dir", out, "--resume"], capsys)
    assert "saved by a run with other settings" in check_error(code, stdout, err, lines=None)
