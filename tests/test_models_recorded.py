"""Checkpoints of timm's own train.py (`model_best.pth.tar`), written here by timm's own CheckpointSaver with a tiny
model: read without --trust-checkpoint (their `args` is an argparse.Namespace, which holds no code), built with the
architecture settings they record (global pool, model kwargs), fed with the data settings they record (mean, std,
size, interpolation) over the tag's, and with the weights timm's training ranked them by: the EMA's when it
validated one, said in the log and the provenance."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

import in9_eval
from tests.helpers import TINY, check_error, run_in_process, run_train
from tests.test_models_hub import images, own_logits, seeded
from tools.models.sources import load_model
from tools.training.checkpoint import CHECKPOINT_NAME

ARCH = "test_resnet"  # timm's tiny test ResNet; its default tag takes 160x160 images, bilinear, mean and std 0.5
MEAN, STD, SIZE = (0.45, 0.4, 0.35), (0.3, 0.25, 0.2), 192


def timm_or_skip():
    timm = pytest.importorskip("timm")
    if ARCH not in timm.list_models():
        pytest.skip(f"timm {timm.__version__} has no {ARCH}")
    return timm


def train_args(**changes) -> argparse.Namespace:
    """What timm's train.py records as `args` (its parsed command line): the fields this toolkit reads, and a
    few others as they come."""
    values = dict(model=ARCH, num_classes=9, img_size=SIZE, input_size=None, mean=list(MEAN), std=list(STD),
                  interpolation="bicubic", crop_pct=0.9, model_ema=True, model_ema_force_cpu=False,
                  model_ema_decay=0.9998, lr=0.05, epochs=10, batch_size=128, opt="sgd", data_dir="/data/in9",
                  amp=False, seed=42, pretrained=True)
    return argparse.Namespace(**{**values, **changes})


def save_with_timms_saver(folder, args: argparse.Namespace, ema: bool,
                          build=None) -> tuple[torch.nn.Module, torch.nn.Module]:
    """model_best.pth.tar as timm's train.py leaves it (CheckpointSaver, a ranked epoch), its model made by `build`
    (default: the 9-class ARCH); (the model, its EMA)."""
    timm = timm_or_skip()
    from timm.utils import CheckpointSaver, ModelEmaV3  # noqa: PLC0415
    model = seeded(build() if build is not None else timm.create_model(ARCH, num_classes=9), 1)
    model_ema = ModelEmaV3(model) if ema else None
    if model_ema is not None:
        seeded(model_ema.module, 2)  # an average that has moved away from the model
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=model_ema, checkpoint_dir=str(folder),
                            recovery_dir=str(folder))
    saver.save_checkpoint(0, metric=71.5)
    return model, model_ema.module if model_ema is not None else None


@pytest.mark.parametrize("case", ["ema", "ema-on-cpu", "no-ema"])
def test_a_timm_training_checkpoint_loads_safely_with_its_data_settings_and_ranked_weights(case, tmp_path, caplog):
    args = train_args(model_ema=case != "no-ema", model_ema_force_cpu=case == "ema-on-cpu")
    model, ema = save_with_timms_saver(tmp_path, args, ema=case != "no-ema")
    path = tmp_path / "model_best.pth.tar"
    with caplog.at_level(logging.INFO, logger="tools"):
        loaded = load_model(checkpoint=path)  # no --trust-checkpoint
    expected = ema if case == "ema" else model  # the EMA ranked the checkpoint only where timm validated it
    batch = images(4)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(expected.eval(), batch, MEAN, STD, SIZE),
                                   rtol=1e-4, atol=1e-4)
    key = "state_dict_ema" if case == "ema" else "state_dict"
    said = [r.getMessage() for r in caplog.records if "timm training checkpoint" in r.getMessage()]
    assert len(said) == 1 and key in said[0], said
    assert key in loaded.checkpoint_format and loaded.arch == f"timm:{ARCH}"
    assert str(list(MEAN)[0]) in loaded.normalization


def test_the_key_given_wins_over_the_ranked_weights(tmp_path):
    model, _ = save_with_timms_saver(tmp_path, train_args(), ema=True)
    loaded = load_model(checkpoint=tmp_path / "model_best.pth.tar", checkpoint_key="state_dict")
    batch = images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(model.eval(), batch, MEAN, STD, SIZE),
                                   rtol=1e-4, atol=1e-4)


def test_recorded_data_settings_that_timm_rejects_are_one_line(dataset, tmp_path, capsys):
    save_with_timms_saver(tmp_path, train_args(img_size=None, input_size=[SIZE, SIZE]), ema=False)  # not C, H, W
    code, out, err = run_in_process(in9_eval.main, ["--data-path", str(dataset.root), "--checkpoint",
                                                    str(tmp_path / "model_best.pth.tar"), "--device", "cpu"], capsys)
    line = check_error(code, out, err, lines=None)
    assert "input_size" in line and "model_best.pth.tar" in line


def test_without_a_validation_split_the_model_ranked_it_not_its_ema(tmp_path, caplog):
    """timm's train.py with `--val-split ''` (timm 0.9.16 on) validates nothing: it ranks its checkpoints by the
    model's training loss, never by its EMA's, so the model's weights are the ones it chose."""
    model, _ = save_with_timms_saver(tmp_path, train_args(val_split=""), ema=True)
    with caplog.at_level(logging.INFO, logger="tools"):
        loaded = load_model(checkpoint=tmp_path / "model_best.pth.tar")
    batch = images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(model.eval(), batch, MEAN, STD, SIZE),
                                   rtol=1e-4, atol=1e-4)
    assert "state_dict:" in loaded.checkpoint_format and "validation" in loaded.checkpoint_format


def test_the_recorded_architecture_settings_build_the_network(tmp_path):
    """The settings timm's train.py built its model with besides the name (`--gp`, `--model-kwargs`) build it
    here too: a max-pooled network is not evaluated with an average pool, whose weights fit it all the same."""
    timm = timm_or_skip()
    args = train_args(model_ema=False, gp="max", model_kwargs={"stem_width": 32})
    model, _ = save_with_timms_saver(tmp_path, args, ema=False,
                                     build=lambda: timm.create_model(ARCH, num_classes=9, global_pool="max",
                                                                     stem_width=32))
    loaded = load_model(checkpoint=tmp_path / "model_best.pth.tar")
    batch = images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(model.eval(), batch, MEAN, STD, SIZE),
                                   rtol=1e-4, atol=1e-4)
    assert loaded.details["arch_args"] == {"global_pool": "max", "stem_width": 32}


@pytest.mark.slow
def test_a_network_fine_tuned_from_it_keeps_its_settings(tiny, tmp_path, capsys):
    """train.py fine-tuning such a checkpoint records the settings its network was built with (global pool, model
    kwargs) in its own checkpoint, which then loads: the network it trained, not one refused for its settings."""
    timm = timm_or_skip()
    args = train_args(model_ema=False, gp="max", model_kwargs={"stem_width": 32})
    save_with_timms_saver(tmp_path, args, ema=False,
                          build=lambda: timm.create_model(ARCH, num_classes=9, global_pool="max", stem_width=32))
    code, _, err = run_train(["--data-path", tiny, "--checkpoint", tmp_path / "model_best.pth.tar", "--epochs", 1,
                              "--batch-size", 6, "--output-dir", tmp_path / "out", *TINY[2:]], capsys)
    assert code == 0, err
    trained = torch.load(tmp_path / "out" / CHECKPOINT_NAME, weights_only=True)
    loaded = load_model(checkpoint=tmp_path / "out" / CHECKPOINT_NAME)
    assert loaded.details["arch_args"] == {"global_pool": "max", "stem_width": 32}
    network = timm.create_model(ARCH, num_classes=9, global_pool="max", stem_width=32)
    network.load_state_dict(trained["model"])
    batch = images(2)
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), own_logits(network.eval(), batch, MEAN, STD, SIZE),
                                   rtol=1e-4, atol=1e-4)
