"""train.py's bad input: one `error:` line that says what is wrong and what to do, exit code 2, no traceback."""

from __future__ import annotations

import shutil
import sys
from copy import deepcopy

import pytest
import torch
from torch import nn

import in9_eval
import train
from tests.helpers import check_error, run_in_process, save_torchscript
from tools.data import synthetic
from tools.errors import UserError
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.training.checkpoint import CHECKPOINT_NAME

TINY = ["--device", "cpu", "--no-progress", "--log-level", "WARNING", "--workers", "0", "--epochs", "1",
        "--batch-size", "6"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad") / "in9"
    synthetic.generate(root, per_class=2, seed=7, split="train")
    return root


@pytest.fixture
def copy(data, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(data, target)
    return target


@pytest.fixture
def fails(capsys, tmp_path):
    def go(*args) -> str:
        argv = TINY + [str(a) for a in args]  # the test's own flags come last and win
        if "--output-dir" not in argv:
            argv += ["--output-dir", str(tmp_path / "out")]
        try:
            code, out, err = run_in_process(train.main, argv, capsys)
        except SystemExit as exc:  # refused by a flag's parser type
            code, (out, err) = exc.code, capsys.readouterr()
        return check_error(code, out, err, lines=None)
    return go


def test_bg_swap_without_masks(copy, fails):
    shutil.rmtree(copy / "fg_mask")
    line = fails("--data-path", copy, "--arch", SMALL_CNN, "--weights", "none", "--method", "bg-swap")
    assert "bg-swap needs foreground masks" in line and "fg_mask is missing" in line


def test_a_class_missing_from_the_training_folder(copy, fails):
    shutil.rmtree(copy / "original" / "train" / "08_fish")
    line = fails("--data-path", copy, "--arch", SMALL_CNN, "--weights", "none")
    assert "has 8 class folders, expected 9" in line


def test_a_head_that_does_not_fit(data, tmp_path, fails):
    path = tmp_path / "ten.pth"
    torch.save(SmallCNN(10).state_dict(), path)
    line = fails("--data-path", data, "--arch", SMALL_CNN, "--checkpoint", path)
    assert "has 10 classes" in line


def test_an_unknown_module_for_lora(data, fails):
    pytest.importorskip("peft")
    line = fails("--data-path", data, "--arch", SMALL_CNN, "--weights", "none", "--peft", "lora",
                 "--peft-modules", "layer4.*.conv2")
    assert "'layer4.*.conv2' matches no module" in line and "features.0" in line


def test_peft_not_installed(data, fails, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    line = fails("--data-path", data, "--arch", SMALL_CNN, "--weights", "none", "--peft", "lora",
                 "--peft-modules", "features.6")
    assert "pip install peft" in line


def oft_starts_as_the_identity(conv: nn.Conv2d, block_size: int) -> bool:
    """Whether the installed peft's OFT on this convolution, at initialisation, computes what the bare one does."""
    import peft  # noqa: PLC0415 (an optional extra)
    base = nn.Sequential(conv)
    adapted = peft.get_peft_model(deepcopy(base),
                                  peft.OFTConfig(r=0, oft_block_size=block_size, target_modules=["0"]))
    x = torch.randn(2, conv.in_channels, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.allclose(adapted(x), base(x), rtol=1e-4, atol=1e-5)


def test_oft_on_a_3x3_convolution_trains_only_where_peft_computes_it_as_its_merged_weights(data, tmp_path, capsys):
    """peft's OFT on a 3x3 convolution starts as the identity up to peft 0.15 and not from 0.16 (to 0.21 at least),
    where the model trained would not be the model saved: train.py refuses before training there, and trains
    where peft computes it consistently. Which of the two the installed peft does is measured on the layer."""
    pytest.importorskip("peft")
    consistent = oft_starts_as_the_identity(SmallCNN(9).features[2], block_size=4)
    out = tmp_path / "oft"
    argv = TINY + ["--data-path", str(data), "--arch", SMALL_CNN, "--weights", "none", "--peft", "oft",
                   "--oft-block-size", "4", "--peft-modules", "features.2", "--output-dir", str(out)]
    code, stdout, err = run_in_process(train.main, argv, capsys)
    if consistent:
        assert code == 0, err
        assert (out / CHECKPOINT_NAME).is_file()
    else:
        assert "at initialisation" in check_error(code, stdout, err, lines=None)
        assert not (out / CHECKPOINT_NAME).exists()


@pytest.mark.parametrize("args, words", [
    (["--method", "erm", "mixup"], "combines with nothing"),
    (["--batch-size", "64"], "fewer than --batch-size 64"),
    (["--peft", "lora"], "needs --peft-modules"),
    (["--freeze", "backbone", "--peft", "lora", "--peft-modules", "fc"], "pick one"),
    (["--swap-prob", "1.5"], "argument --swap-prob: '1.5' is not a number from 0 to 1"),
    (["--method", "bg-swap", "--train-variation", "mixed_rand"], "cannot be combined"),
    (["--eval-challenge"], "add --eval-data"),
])
def test_contradictory_or_impossible_settings(args, words, data, fails):
    line = fails("--data-path", data, "--arch", SMALL_CNN, "--weights", "none", *args)
    assert words in line


@pytest.mark.parametrize("args, words", [
    (["--swap-prob", "0.5"], "--swap-prob does nothing without --method bg-swap"),
    (["--swap-same-class-prob", "0.5"], "--swap-same-class-prob does nothing without --method bg-swap"),
    (["--method", "bg-swap", "--swap-prob", "0", "--swap-same-class-prob", "0.5"], "with --swap-prob 0"),
    (["--method", "cutmix", "--mixup-alpha", "0.4"], "--mixup-alpha does nothing without mixup in --method"),
    (["--method", "bg-swap", "mixup", "--cutmix-alpha", "0.5"], "--cutmix-alpha does nothing without cutmix"),
    (["--swa-start-epoch", "0"], "--swa-start-epoch does nothing without --swa"),
    (["--swa-lr", "0.01"], "--swa-lr does nothing without --swa"),
    (["--lora-rank", "8"], "--lora-rank does nothing without --peft lora"),
    (["--peft", "oft", "--peft-modules", "fc", "--lora-rank", "8"], "--lora-rank does nothing without --peft lora"),
    (["--peft", "lora", "--peft-modules", "fc", "--oft-block-size", "4"], "--oft-block-size does nothing without"),
    (["--momentum", "0.9"], "--momentum does nothing without --optimizer sgd"),  # its default value, given
    (["--optimizer", "adamw", "--momentum", "0.5"], "--momentum does nothing without --optimizer sgd"),
    (["--no-augment", "--crop-scale", "0.5"], "--crop-scale does nothing with --no-augment"),
    (["--eval-batch-size", "4"], "--eval-batch-size does nothing without --eval-data"),
    (["--checkpoint-key", "model"], "--checkpoint-key does nothing without a checkpoint"),
    (["--trust-checkpoint"], "--trust-checkpoint does nothing without a checkpoint"),
])
def test_a_flag_that_would_do_nothing_is_refused(args, words, data, fails):
    line = fails("--data-path", data, "--weights", "none", *args)
    assert words in line and "drop it" in line


@pytest.mark.parametrize("args", [
    ["--method", "bg-swap", "--swap-prob", "0.5", "--swap-same-class-prob", "0.5"],
    ["--method", "cutmix", "mixup", "--mixup-alpha", "0.4", "--cutmix-alpha", "0.5"],
    ["--swa", "--swa-start-epoch", "0", "--swa-lr", "0.01"],
    ["--optimizer", "sgd", "--momentum", "0.5"],
    ["--augment", "--crop-scale", "0.5"],
    ["--eval-data", "d", "--eval-batch-size", "4", "--eval-challenge"],
    ["--checkpoint", "c.pt", "--checkpoint-key", "model", "--trust-checkpoint"],
    ["--arch", f"{SMALL_CNN}@file:c.pt", "--trust-checkpoint"],
])
def test_the_same_flags_where_they_act_are_taken(args):
    """Each of those flags where it acts, even at its default value: the settings take the values given."""
    from tools.training.config import config_from_args  # noqa: PLC0415
    config = config_from_args(train.build_parser().parse_args(["--data-path", "d", *args]))
    given = train.build_parser().parse_args(["--data-path", "d", *args])
    for name in ("swap_prob", "swap_same_class_prob", "mixup_alpha", "cutmix_alpha", "swa_start_epoch", "swa_lr",
                 "momentum", "crop_scale", "eval_batch_size", "checkpoint_key"):
        if getattr(given, name) is not None:
            assert getattr(config, name) == getattr(given, name)


def test_a_list_flag_given_twice_takes_both_lists():
    """`--method bg-swap --method mixup` and `--peft-modules A --peft-modules B` mean both, as the same words in
    one flag do: the second flag replaced the first, silently (mixup alone trained, A left unadapted); erm given
    beside another method in two flags is refused as in one."""
    from tools.training.config import Method, config_from_args  # noqa: PLC0415

    def config(*args):
        return config_from_args(train.build_parser().parse_args(["--data-path", "d", *args]))

    assert config("--method", "bg-swap", "--method", "mixup", "cutmix").methods == [Method.BG_SWAP, Method.MIXUP,
                                                                                     Method.CUTMIX]
    assert config("--method", "mixup", "--method", "mixup").methods == [Method.MIXUP]
    assert config().methods == [Method.ERM]
    assert config("--peft", "lora", "--peft-modules", "layer3.*", "--peft-modules", "layer4.*").peft_modules == [
        "layer3.*", "layer4.*"]
    with pytest.raises(UserError, match="erm is plain training and combines with nothing"):
        config("--method", "erm", "--method", "mixup")


@pytest.mark.parametrize("args, words", [
    (["--lr", "-0.1"], "argument --lr: '-0.1' is not a positive, finite number"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a positive, finite number"),
    (["--swa", "--swa-lr", "0"], "argument --swa-lr: '0' is not a positive, finite number"),
    (["--weight-decay", "-0.05"], "argument --weight-decay: '-0.05' is not a finite number, at least 0"),
    (["--weight-decay", "inf"], "argument --weight-decay: 'inf' is not a finite number, at least 0"),
    (["--optimizer", "sgd", "--momentum", "-0.5"],
     "argument --momentum: '-0.5' is not a number at least 0 and below 1"),
    (["--warmup-epochs", "-1"], "argument --warmup-epochs: '-1' is not a finite number of epochs, at least 0"),
    (["--warmup-epochs", "1"], "--warmup-epochs 1 is as long as training (--epochs 1) or longer"),
    (["--epochs", "2", "--warmup-epochs", "3"], "--warmup-epochs 3 is as long as training (--epochs 2) or longer"),
    (["--epochs", "4", "--swa", "--warmup-epochs", "3.5"], "outlasts the epochs before --swa averages"),
    (["--epochs", "4", "--swa", "--swa-start-epoch", "0", "--warmup-epochs", "0.5"], "outlasts the epochs before"),
])
def test_negative_rates_and_decays_and_a_warm_up_that_never_ends(args, words, data, fails):
    assert words in fails("--data-path", data, "--weights", "none", *args)


@pytest.fixture
def no_downloads(tmp_path, monkeypatch):
    """An empty torch hub cache whose downloads are recorded and refused: the URLs asked for."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    asked = []

    def refuse(url, *args, **kwargs):
        asked.append(url)
        raise AssertionError(f"downloaded {url}")

    monkeypatch.setattr(torch.hub, "download_url_to_file", refuse)
    return asked


def test_a_missing_data_folder_is_found_before_the_weights_are_downloaded(tmp_path, fails, no_downloads):
    """The defaults (resnet50 with ImageNet weights) and a folder that does not exist: the folder is the error,
    and nothing was downloaded."""
    line = fails("--data-path", tmp_path / "nonexistent")
    assert "nonexistent does not exist" in line and "--data-path" in line
    assert no_downloads == []


def test_a_training_folder_without_a_class_is_found_before_the_weights_are_downloaded(copy, fails, no_downloads):
    shutil.rmtree(copy / "original" / "train" / "08_fish")
    assert "has 8 class folders, expected 9" in fails("--data-path", copy)
    assert no_downloads == []


def test_the_eval_data_is_checked_before_training(data, tmp_path, fails, no_downloads):
    """A missing --eval-data folder, or one without the challenge's masks, ends the run before the model is
    downloaded or trained: no checkpoint is written, and the line names --eval-data."""
    out = tmp_path / "out"
    line = fails("--data-path", data, "--eval-data", tmp_path / "missing", "--output-dir", out)
    assert "missing does not exist" in line and "pass --eval-data" in line
    test = synthetic.generate(tmp_path / "test", per_class=1, seed=9).root
    shutil.rmtree(test / "fg_mask")
    line = fails("--data-path", data, "--eval-data", test, "--eval-challenge", "--output-dir", out)
    assert "fg_mask" in line
    assert no_downloads == [] and not (out / CHECKPOINT_NAME).exists()


@pytest.mark.parametrize("arch", ["clip:ViT-B-32/openai", "hf:google/vit-base-patch16-224", "hf:/runs/vit"])
@pytest.mark.parametrize("weights", [[], ["--weights", "none"]])
def test_a_model_train_py_cannot_build_is_refused_before_anything_is_loaded(arch, weights, tmp_path, fails,
                                                                             monkeypatch):
    """CLIP zero-shot and transformers models are evaluated, not trained: named as --arch, they were loaded (the
    weights downloaded, CLIP's prompts encoded) and then refused as "not an architecture". The flag is refused
    as train.py's other flags are, before the data is read, saying what train.py trains."""
    from tools.training import loop  # noqa: PLC0415

    def no_loading(*args, **kwargs):
        raise AssertionError("loaded")

    monkeypatch.setattr(loop, "load_model", no_loading)
    line = fails("--data-path", tmp_path / "nonexistent", "--arch", arch, *weights)
    assert f"train.py cannot fine-tune {arch}" in line
    assert "NAME (torchvision), timm:NAME, toolkit:NAME" in line and "in9_eval.py" in line


def test_the_small_cnn_without_weights_says_how_to_start_from_random_ones(data, fails):
    """The toolkit's own architecture has no pretrained weights: the line names train.py's --weights none."""
    line = fails("--data-path", data, "--arch", SMALL_CNN)
    assert "has no pretrained weights" in line and "--weights none" in line


@pytest.mark.parametrize("method, flag, value", [("mixup", "--mixup-alpha", "0"), ("cutmix", "--cutmix-alpha", "-1"),
                                                ("mixup", "--mixup-alpha", "nan"), ("cutmix", "--cutmix-alpha", "inf")])
def test_a_mixing_parameter_that_is_no_beta_parameter_is_refused_before_start_up(method, flag, value, data, fails,
                                                                                 monkeypatch):
    """Beta(A, A) needs a positive, finite A: refused when the settings are read, before any model or data."""
    from tools.training import loop  # noqa: PLC0415
    monkeypatch.setattr(loop, "starting_point", lambda config: pytest.fail("the run started"))
    line = fails("--data-path", data, "--arch", SMALL_CNN, "--weights", "none", "--method", method, flag, value)
    assert flag in line and "positive" in line


def test_a_torchscript_start_cannot_be_rebuilt(data, tmp_path, fails):
    path = tmp_path / "model.ts"
    save_torchscript(SmallCNN(9), path)
    line = fails("--data-path", data, "--checkpoint", path, "--trust-checkpoint")
    assert "cannot be rebuilt for training" in line


def test_evaluation_refuses_an_arch_that_contradicts_a_trained_checkpoint(data, tmp_path, capsys):
    code, _, err = run_in_process(train.main,
                                  ["--data-path", str(data), "--arch", SMALL_CNN, "--weights", "none",
                                   "--output-dir", str(tmp_path / "run"), *TINY], capsys)
    assert code == 0, err
    code, out, err = run_in_process(
        in9_eval.main,
        ["--data-path", str(synthetic.generate(tmp_path / "test", per_class=1, seed=8).root), "--checkpoint",
         str(tmp_path / "run" / CHECKPOINT_NAME), "--arch", "resnet18", "--device", "cpu", "--no-progress"], capsys)
    assert "contradicts checkpoint" in check_error(code, out, err, lines=None)


def test_oft_on_a_convolution_that_is_not_square_is_refused_in_one_line(tmp_path):
    """peft's OFT sizes its rotation as in_channels x k0 x k0, so a 1x7 convolution (Inception's) passes the
    block-size check and then fails in the forward pass: refused before peft is asked."""
    pytest.importorskip("peft")
    from tools.errors import UserError  # noqa: PLC0415
    from tools.training import adapters  # noqa: PLC0415
    from tools.training.config import Adapter, TrainConfig  # noqa: PLC0415

    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.Conv2d(4, 4, (1, 7), padding=(0, 3)), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 9))  # 4 x 1 x 7 = 28 inputs: block size 4 divides them
    config = TrainConfig(data_path=tmp_path, output_dir=tmp_path, peft=Adapter.OFT, peft_modules=["1"],
                         oft_block_size=4)
    with pytest.raises(UserError, match=r"--peft oft cannot adapt 1, a 1x7 convolution"):
        adapters.attach(model, config, ["4.weight", "4.bias"])
