"""Mistakes a user can make end in one line, 'error: ...', that says what is wrong, and exit code 2."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image
from torch import nn

import in9_eval
from tests.helpers import check_error, save_torchscript
from tools.data import layout

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def run(capsys, tmp_path):
    """in9_eval through cli.run_main in this process; returns its one stderr line, checked to be an error."""

    def go(*args, lines: int | None = 1) -> str:
        argv = [str(a) for a in args]
        for flag, value in (("--device", "cpu"), ("--output-dir", tmp_path / "out")):
            if flag not in argv:
                argv += [flag, str(value)]
        argv += ["--no-progress", "--log-level", "WARNING"]
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        try:
            code = in9_eval.main(argv)
        finally:
            root.handlers[:] = handlers
            root.setLevel(level)
        out, err = capsys.readouterr()
        return check_error(code, out, err, lines)

    return go


def mentions(line: str, *fragments: str) -> bool:
    """Every fact in the line: the data checks word their messages in more than one way."""
    missing = [f for f in fragments if f not in line]
    assert not missing, f"{line!r} does not mention {missing}"
    return True


def run_script(*args) -> str:
    """python in9_eval.py ARGS as a subprocess from the repository root; returns its error line."""
    proc = subprocess.run([sys.executable, str(REPO / "in9_eval.py"), *map(str, args), "--no-progress",
                           "--log-level", "WARNING"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    # other lines may be Python warnings from torch; the error is still one line, the last
    return check_error(proc.returncode, proc.stdout, proc.stderr, lines=None)


@pytest.fixture
def data(dataset, tmp_path) -> Path:
    """A copy of the generated dataset, to break."""
    return Path(shutil.copytree(dataset.root, tmp_path / "bg_challenge"))


def eval_all(data_root: Path, color_ts) -> list:
    return ["--data-path", data_root, "--eval-dataset", "all", "--checkpoint", color_ts[9], "--trust-checkpoint"]


# ----------------------------------------------------------------------------------------------------------
# Data

@pytest.mark.slow
def test_data_path_missing_as_a_script(tmp_path, color_ts):
    missing = tmp_path / "nowhere"
    line = run_script("--data-path", missing, "--checkpoint", color_ts[9], "--trust-checkpoint", "--device", "cpu",
                      "--output-dir", tmp_path / "out")
    assert mentions(line, f"data path {missing} does not exist", "--data-path")


def test_variation_missing(run, data, color_ts):
    shutil.rmtree(data / "mixed_next")
    line = run(*eval_all(data, color_ts))
    assert mentions(line, "mixed_next", "missing", str(data))


def test_variation_missing_when_asked_for_alone(run, data, color_ts):
    shutil.rmtree(data / "only_fg")
    line = run("--data-path", data, "--eval-dataset", "only_fg", "--checkpoint", color_ts[9], "--trust-checkpoint")
    assert mentions(line, "only_fg", "missing")


@pytest.mark.parametrize("change,count", [("remove", 8), ("add", 10)])
def test_variation_without_nine_class_folders(change, count, run, data, color_ts):
    folder = data / "only_bg_t" / "val"
    if change == "remove":
        shutil.rmtree(folder / "08_fish")
    else:
        (folder / "09_extra").mkdir()
        shutil.copy(next((folder / "00_dog").iterdir()), folder / "09_extra")
    line = run(*eval_all(data, color_ts))
    assert mentions(line, "only_bg_t", f"{count} class folders, expected 9")
    if change == "add":
        assert mentions(line, "09_extra")


def test_empty_class_folder(run, data, color_ts):
    folder = data / "no_fg" / "val" / "03_reptile"
    for path in folder.iterdir():
        path.unlink()
    line = run(*eval_all(data, color_ts))
    assert mentions(line, "no_fg/val/03_reptile", "no images")


def test_unreadable_image_is_named(run, data, color_ts):
    """A later image of a class: found when it is decoded, in a decoding thread."""
    path = data / "mixed_rand" / "val" / "02_vehicle" / "synth2_00001.JPEG"
    path.write_bytes(b"this is not a JPEG")
    line = run(*eval_all(data, color_ts))
    assert mentions(line, str(path))
    assert "cannot read" in line or "unreadable" in line


@pytest.mark.parametrize("content", [b"", b"\x00" * 100])
def test_unreadable_first_image_is_named(content, run, data, color_ts):
    """The first image of a class: the checks before the run may find it."""
    path = data / "mixed_same" / "val" / "04_carnivore" / "synth4_00000.JPEG"
    path.write_bytes(content)
    line = run(*eval_all(data, color_ts))
    assert mentions(line, "mixed_same", "04_carnivore", path.name)
    assert "cannot read" in line or "unreadable" in line


def test_truncated_image_is_named(run, data, color_ts):
    path = data / "original" / "val" / "05_insect" / "synth5_00002.JPEG"
    path.write_bytes(path.read_bytes()[:600])
    line = run(*eval_all(data, color_ts))
    assert mentions(line, str(path))
    assert "cannot read" in line or "unreadable" in line


@pytest.mark.parametrize("index", [0, 3])
def test_image_of_the_wrong_size_is_named(index, run, data, color_ts):
    path = data / "only_fg" / "val" / "07_primate" / f"synth7_{index:05d}.JPEG"
    Image.new("RGB", (100, 80), (10, 20, 30)).save(path, format="JPEG")
    line = run(*eval_all(data, color_ts))
    assert mentions(line, "only_fg", "07_primate", path.name, "100x80", "224x224")


@pytest.mark.slow
def test_bad_image_as_a_script(data, color_ts, tmp_path):
    """An image that fails to decode also ends as one line from the real script."""
    path = data / "mixed_same" / "val" / "04_carnivore" / "synth4_00003.JPEG"
    path.write_bytes(b"\x00" * 100)
    line = run_script(*eval_all(data, color_ts), "--device", "cpu", "--output-dir", tmp_path / "out")
    assert mentions(line, str(path))


# ----------------------------------------------------------------------------------------------------------
# Models and checkpoints

class Linear10(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3)).repeat(1, 4)[:, :10]


def test_torchscript_with_ten_classes(run, dataset, tmp_path):
    path = tmp_path / "ten.ts"
    save_torchscript(Linear10(), path)
    line = run("--data-path", dataset.root, "--checkpoint", path, "--trust-checkpoint")
    assert line == (f"error: the model in {path} has 10 classes; the toolkit evaluates 9-class (IN-9) or "
                    f"1000-class (ImageNet) models")


def test_state_dict_with_ten_classes(run, dataset, tmp_path):
    path = tmp_path / "ten.pth"
    torch.save(torchvision.models.shufflenet_v2_x0_5(num_classes=10).state_dict(), path)
    line = run("--data-path", dataset.root, "--arch", "shufflenet_v2_x0_5", "--checkpoint", path)
    assert line.startswith(f"error: checkpoint {path} has 10 classes; the toolkit evaluates 9-class")


def test_thousand_classes_with_in9(run, dataset, color_ts):
    line = run("--data-path", dataset.root, "--checkpoint", color_ts[1000], "--trust-checkpoint", "--in9")
    assert line == (f"error: --in9 says a 9-class model, but the model in {color_ts[1000]} has 1000 classes; "
                    f"drop --in9 or pass the 9-class checkpoint")


@pytest.mark.parametrize("with_checkpoint", [False, True])
def test_unknown_arch_lists_close_matches(with_checkpoint, run, dataset, color_ts, tmp_path):
    extra = []
    if with_checkpoint:
        extra = ["--checkpoint", tmp_path / "sd.pth"]
        torch.save({"fc.weight": torch.zeros(9, 4)}, tmp_path / "sd.pth")
    line = run("--data-path", dataset.root, "--arch", "resnet5", *extra)
    assert line.startswith("error: unknown architecture 'resnet5' (close matches: resnet50")
    assert "--arch takes a torchvision classification model name" in line


def test_unknown_weights(run, dataset):
    line = run("--data-path", dataset.root, "--arch", "resnet18", "--weights", "IMAGENET1K_V9")
    assert line == "error: unknown weights 'IMAGENET1K_V9' for resnet18 (close matches: IMAGENET1K_V1); " \
                   "valid: IMAGENET1K_V1, DEFAULT"


@pytest.mark.parametrize("zip_format", [True, False])
def test_unsafe_pickle(zip_format, run, dataset, tmp_path):
    path = tmp_path / "pickled.pth"
    torch.save(nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten()), path, _use_new_zipfile_serialization=zip_format)
    line = run("--data-path", dataset.root, "--arch", "resnet18", "--checkpoint", path)
    assert line.startswith(f"error: checkpoint {path} needs arbitrary unpickling (blocked globals: ")
    # a zip checkpoint lists every blocked global; a legacy one, the first torch meets
    names = ["torch.nn.modules.container.Sequential"]
    if zip_format:
        names += ["torch.nn.modules.conv.Conv2d", "torch.nn.modules.flatten.Flatten"]
    for name in names:
        assert name in line
    assert line.endswith("if you trust the file, rerun with --trust-checkpoint")


@pytest.mark.parametrize("trust", [False, True])
def test_not_a_checkpoint(trust, run, dataset, tmp_path):
    """Not a pickle at all: said so, not 'needs arbitrary unpickling', and with trust no traceback."""
    path = tmp_path / "notes.pth"
    path.write_text("not a model\n")
    line = run("--data-path", dataset.root, "--checkpoint", path, *(["--trust-checkpoint"] if trust else []),
               lines=2 if trust else 1)  # with trust, a warning about full unpickling comes first
    assert line.startswith(f"error: cannot read checkpoint {path}: it does not unpickle (")
    assert line.endswith("); is it a PyTorch file?")


def test_corrupt_checkpoint(run, dataset, tmp_path):
    path = tmp_path / "cut.pth"
    torch.save({"fc.weight": torch.zeros(9, 4)}, path)
    path.write_bytes(path.read_bytes()[:300])
    line = run("--data-path", dataset.root, "--checkpoint", path)
    assert line.startswith(f"error: cannot read checkpoint {path}: ")


def test_missing_checkpoint(run, dataset, tmp_path):
    line = run("--data-path", dataset.root, "--checkpoint", tmp_path / "absent.pth")
    assert line == f"error: checkpoint {tmp_path / 'absent.pth'} does not exist; check the path"


def test_pretrained_weights_offline(run, dataset, tmp_path, monkeypatch):
    """No network: the message names the file and where to put it."""
    torch_home = tmp_path / "torch_home"
    torch_home.mkdir()
    monkeypatch.setenv("TORCH_HOME", str(torch_home))

    def no_network(url, dst, *args, **kwargs):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    line = run("--data-path", dataset.root, "--arch", "resnet18")  # nothing else: no "Downloading: ..." from torch
    target = torch_home / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert line == (f"error: cannot download https://download.pytorch.org/models/resnet18-f37072fd.pth "
                    f"(network is unreachable); offline, fetch that file elsewhere and put it at {target} "
                    f"(set TORCH_HOME to move {torch_home})")
    assert list(torch_home.rglob("*.pth")) == []


# ----------------------------------------------------------------------------------------------------------
# Running

@pytest.mark.parametrize("device,message", [
    ("cuda:7", "error: device cuda:7 is not available: this machine has "),
    ("banana", "error: unknown device 'banana'; use cuda, cuda:N, mps or cpu"),
])
def test_unavailable_device(device, message, run, dataset, color_ts):
    line = run("--data-path", dataset.root, "--checkpoint", color_ts[9], "--trust-checkpoint", "--device", device)
    assert line.startswith(message)


@pytest.mark.parametrize("flag", ["--batch-size", "--workers"])
def test_non_positive_counts(flag, dataset, color_ts, capsys):
    with pytest.raises(SystemExit) as exc:  # refused by the flag's parser type, before anything runs
        in9_eval.main(["--data-path", str(dataset.root), "--checkpoint", str(color_ts[9]), flag, "0"])
    line = check_error(exc.value.code, *capsys.readouterr())
    assert line.startswith(f"error: argument {flag}: '0' is not a whole number")


# ----------------------------------------------------------------------------------------------------------
# First contact: the data path's default, and the data checked before any model is built

def test_data_path_defaults_to_the_environment_then_data_bg_challenge(run, dataset, color_ts, tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BG_CHALLENGE_DATA", raising=False)
    line = run("--checkpoint", color_ts[9], "--trust-checkpoint")
    assert mentions(line, "data/bg_challenge", "$BG_CHALLENGE_DATA", "--data-path",
                    "python -m tools.data fetch --data-path data/bg_challenge")
    monkeypatch.setenv("BG_CHALLENGE_DATA", str(dataset.root))
    argv = ["--checkpoint", str(color_ts[9]), "--trust-checkpoint", "--device", "cpu", "--output-dir",
            str(tmp_path / "o"),
            "--no-progress", "--log-level", "WARNING"]
    assert in9_eval.main(argv) == 0
    assert capsys.readouterr().out.startswith("Accuracy on original is ")
    monkeypatch.delenv("BG_CHALLENGE_DATA")
    (tmp_path / "data").mkdir()
    shutil.copytree(dataset.root, tmp_path / "data" / "bg_challenge")
    assert in9_eval.main(argv) == 0


@pytest.mark.parametrize("script", ["in9_eval", "challenge_eval"])
@pytest.mark.parametrize("breakage", ["no folder", "missing variation", "unreadable image"])
def test_bad_data_is_reported_before_any_model_is_built(script, breakage, data, color_ts, tmp_path, monkeypatch,
                                                        capsys):
    import challenge_eval  # noqa: PLC0415
    from tools import options  # noqa: PLC0415
    from tools.models import sources  # noqa: PLC0415

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the data was checked")

    monkeypatch.setattr(sources, "load_model", no_model)
    monkeypatch.setattr(options, "load_model", no_model)
    root = data
    if breakage == "no folder":
        root = tmp_path / "nowhere"
    elif breakage == "missing variation":
        shutil.rmtree(data / "only_bg_t")
    else:
        # the first image of a class: the quick check reads its header (in9 finds a later one as it decodes)
        (data / "only_bg_t" / "val" / "00_dog" / "synth0_00000.JPEG").write_bytes(b"not an image")
    module = in9_eval if script == "in9_eval" else challenge_eval
    argv = ["--data-path", str(root), "--arch", "resnet18", "--device", "cpu", "--output-dir", str(tmp_path / "o"),
            "--no-progress", "--log-level", "WARNING", "--no-cache" if script == "challenge_eval" else "--categories"]
    if script == "in9_eval":
        argv += ["--eval-dataset", "all"]
    code = module.main(argv)
    out, err = capsys.readouterr()
    line = check_error(code, out, err)
    assert mentions(line, "nowhere" if breakage == "no folder" else "only_bg_t")


def test_results_files_follow_the_umask(dataset, color_ts, tmp_path, capsys):
    previous = os.umask(0o022)
    try:
        argv = ["--data-path", str(dataset.root), "--checkpoint", str(color_ts[9]), "--trust-checkpoint", "--device",
                "cpu",
                "--output-dir", str(tmp_path / "o"), "--results-file", str(tmp_path / "r.json"), "--no-progress",
                "--log-level", "WARNING"]
        assert in9_eval.main(argv) == 0
    finally:
        os.umask(previous)
    capsys.readouterr()
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o644


def test_arch_ignored_for_a_torchscript_file_is_said_once(dataset, color_ts, tmp_path, capsys):
    argv = ["--data-path", str(dataset.root), "--checkpoint", str(color_ts[9]), "--trust-checkpoint", "--arch",
            "resnet18", "--device",
            "cpu", "--output-dir", str(tmp_path / "o"), "--no-progress", "--log-level", "WARNING"]
    assert in9_eval.main(argv) == 0
    err = capsys.readouterr().err
    assert sum("--arch resnet18 is ignored" in line for line in err.splitlines()) == 1


def test_no_in9_contradicting_a_nine_class_checkpoint(run, dataset, color_ts):
    line = run("--data-path", dataset.root, "--checkpoint", color_ts[9], "--trust-checkpoint", "--no-in9")
    assert mentions(line, "--no-in9 says a 1000-class ImageNet model", "9 classes")


def test_lonely_mask_names_the_image_extension_in_use(tmp_path):
    from tools.data import image_sets, synthetic  # noqa: PLC0415

    root = synthetic.generate(tmp_path / "bg", per_class=2, seed=3).root
    for path in sorted((root / "original").rglob("*.JPEG")):  # data built with --image-format png
        with Image.open(path) as img:
            img.convert("RGB").save(path.with_suffix(".png"))
        path.unlink()
    victim = sorted((root / "original" / "val" / "01_bird").iterdir())[0]
    victim.unlink()
    with pytest.raises(image_sets.UserError, match=rf"has no image \S*{victim.stem}\.png "):
        layout.list_foregrounds(root)
