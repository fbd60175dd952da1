"""The checkpoint reader on broken files, in this process: every first byte of a text file, real checkpoints
(zip and legacy layouts) cut at many lengths, zip archives with damaged or missing members, random bytes and
random damage to a checkpoint's pickle (fixed seeds), and pickles of the wrong things. Each either loads or ends
in one short error line (tools.errors.UserError); nothing else escapes."""

from __future__ import annotations

import hashlib
import io
import pickle
import random
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torchvision

import in9_eval
from tests.helpers import check_error, run_in_process
from tools.errors import UserError
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.models.checkpoints import TRAINED_FORMAT
from tools.models.sources import load_model

LONGEST_LINE = 600  # an error line names the file and the problem, never a whole key list
SEED = 36


def outcome(path: Path, **options) -> str | None:
    """None when the file loads or is refused in one short line; else what went wrong, for the test's report."""
    try:
        load_model(checkpoint=path, **options)
    except UserError as exc:
        text = str(exc)
        if "\n" in text or len(text) > LONGEST_LINE:
            return f"{path.name}: an error of {len(text)} characters, {text.count(chr(10)) + 1} lines"
    except Exception as exc:  # noqa: BLE001 (what the test is looking for)
        return f"{path.name}: {type(exc).__name__}: {str(exc)[:200]}"
    return None


def check_all(paths: list[Path], **options) -> None:
    escaped = [problem for path in paths if (problem := outcome(path, **options)) is not None]
    assert not escaped, f"{len(escaped)} of {len(paths)} files escaped:\n" + "\n".join(escaped[:20])


def trained(seed: int = 0) -> dict:
    """A checkpoint as train.py writes it (the small CNN, its architecture and normaliser recorded): it loads."""
    torch.manual_seed(seed)
    return {"format": TRAINED_FORMAT, "arch": SMALL_CNN, "num_classes": 9, "arch_args": {}, "input_size": [224, 224],
            "interpolation": None, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
            "model": SmallCNN(9).state_dict(), "method": "erm", "data": {}, "train_args": {}, "precision": "fp32"}


def saved(obj, zip_format: bool = True) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=zip_format)
    return buffer.getvalue()


def written(folder: Path, name: str, content: bytes) -> Path:
    path = folder / name
    path.write_bytes(content)
    return path


def test_a_text_file_with_any_first_byte(tmp_path):
    """A text (or any) file whose first byte is each of the 256: the unpickler reads it as an opcode."""
    check_all([written(tmp_path, f"first-{b:03d}.pt", bytes([b]) + b"ello, this is not a checkpoint\n" * 3)
               for b in range(256)])


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_a_real_checkpoint_cut_short_at_many_lengths(zip_format, tmp_path):
    content = saved(trained(), zip_format)
    assert outcome(written(tmp_path, "whole.pt", content)) is None
    lengths = sorted({*range(0, 80), *range(80, len(content), max(1, len(content) // 60)), len(content) - 1})
    check_all([written(tmp_path, f"cut-{n}.pt", content[:n]) for n in lengths])


def rezipped(content: bytes, change) -> bytes:
    """The zip checkpoint's members rewritten by change(name, data) -> data or None (left out)."""
    source, out = zipfile.ZipFile(io.BytesIO(content)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = change(info.filename, source.read(info))
            if data is not None:
                target.writestr(info, data)
    return out.getvalue()


def test_zip_checkpoints_with_damaged_or_missing_members(tmp_path):
    content = saved(trained())
    names = zipfile.ZipFile(io.BytesIO(content)).namelist()
    cases = {}
    for name in names:
        short = name.split("/", 1)[-1].replace("/", "_")
        cases[f"without-{short}"] = rezipped(content, lambda n, d, name=name: None if n == name else d)
        cases[f"emptied-{short}"] = rezipped(content, lambda n, d, name=name: b"" if n == name else d)
        cases[f"halved-{short}"] = rezipped(content, lambda n, d, name=name: d[: len(d) // 2] if n == name else d)
        cases[f"text-{short}"] = rezipped(content, lambda n, d, name=name: b"not this\n" if n == name else d)
    bad_crc = bytearray(content)
    data_start = bad_crc.index(b"PK\x03\x04") + 30 + len(names[0]) + 70  # within the first member's data
    bad_crc[data_start] ^= 0xFF
    cases["bad-crc"] = bytes(bad_crc)
    check_all([written(tmp_path, f"{label}.pt", data) for label, data in cases.items()])


@pytest.mark.slow
def test_random_bytes_and_random_damage_to_the_pickle(tmp_path):
    rng = random.Random(SEED)
    content = saved(trained())
    pickle_name = next(n for n in zipfile.ZipFile(io.BytesIO(content)).namelist() if n.endswith("data.pkl"))
    paths = [written(tmp_path, f"random-{i}.pt", rng.randbytes(rng.choice([1, 7, 64, 1000, 20000])))
             for i in range(60)]

    def damage(data: bytes) -> bytes:
        data = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data)

    for i in range(120):
        flipped = rezipped(content, lambda n, d: damage(d) if n == pickle_name else d)
        paths.append(written(tmp_path, f"damaged-pickle-{i}.pt", flipped))
    legacy = saved(trained(), zip_format=False)
    paths += [written(tmp_path, f"damaged-legacy-{i}.pt", damage(legacy)) for i in range(60)]
    check_all(paths)


WRONG_THINGS = {
    "int-keys": {1: torch.zeros(3)},
    "mixed-keys": {"fc.weight": torch.zeros(9, 32), 2: torch.zeros(9)},
    "list": [torch.zeros(3)],
    "tensor": torch.zeros(3, 3),
    "none": None,
    "string": "model",
    "nested-model": {"model": {"model": {"fc.weight": torch.zeros(9, 32)}}},
    "model-a-list": {"model": [1, 2, 3]},
    "state-dict-of-numbers": {"state_dict": {"fc.weight": 1.0}},
    "head-of-no-rows": {"fc.weight": torch.zeros(0, 32), "fc.bias": torch.zeros(0)},
    "head-a-scalar": {"fc.weight": torch.tensor(1.0), "fc.bias": torch.tensor(1.0)},
    "head-of-ints": {k: v.long() for k, v in SmallCNN(9).state_dict().items()},
    "trained-no-mean": {k: v for k, v in trained().items() if k != "mean"},
    "trained-text-mean": {**trained(), "mean": "bright"},
    "trained-short-std": {**trained(), "std": [0.2]},
    "trained-arch-number": {**trained(), "arch": 5},
    "trained-arch-unknown": {**trained(), "arch": "no_such_net"},
    "trained-model-missing": {k: v for k, v in trained().items() if k != "model"},
    "trained-odd-input": {**trained(), "input_size": [224]},
    "trained-odd-arch-args": {**trained(), "arch_args": {"width": 3}},
    "timm-shaped": {"arch": SMALL_CNN, "state_dict": SmallCNN(9).state_dict(), "version": 2, "args": 7},
    "normaliser-without-model": {"normalizer.new_mean": torch.zeros(3), "normalizer.new_std": torch.ones(3)},
    "ordered-empty": OrderedDict(),
}


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
@pytest.mark.slow
def test_pickles_of_the_wrong_things(zip_format, tmp_path):
    check_all([written(tmp_path, f"{label}.pt", saved(obj, zip_format)) for label, obj in WRONG_THINGS.items()])
    check_all([written(tmp_path, f"arch-{label}.pt", saved(obj, zip_format)) for label, obj in WRONG_THINGS.items()],
              arch=SMALL_CNN)


def test_a_plain_pickle_that_is_no_torch_file(tmp_path):
    """pickle.dump of plain data (no torch magic number, no zip): the legacy reader's first load meets it."""
    paths = [written(tmp_path, f"pickle-{protocol}.pt", pickle.dumps({"fc.weight": [1, 2]}, protocol=protocol))
             for protocol in range(pickle.HIGHEST_PROTOCOL + 1)]
    check_all(paths)
    check_all(paths, trust=True)


TEXT_STARTS = "abehjqrstuMNQR("  # the first characters that made the unpickler raise IndexError or KeyError


@pytest.mark.parametrize("first", TEXT_STARTS)
@pytest.mark.slow
def test_a_text_file_as_checkpoint_is_one_error_line_from_the_script(first, dataset, tmp_path, capsys):
    path = written(tmp_path, "notes.txt", f"{first}ll my notes about the run\n".encode())
    code, out, err = run_in_process(in9_eval.main, ["--data-path", str(dataset.root), "--checkpoint", str(path),
                                                    "--device", "cpu", "--no-progress"], capsys)
    assert "cannot read checkpoint" in check_error(code, out, err)


def test_the_other_weights_only_readers_refuse_broken_files_in_one_line(tmp_path, monkeypatch):
    """train.py's resume state and a torchvision weights file in torch's hub cache, read the same way."""
    from tools.models.record import ModelRecord  # noqa: PLC0415
    from tools.models.sources import _download_weights  # noqa: PLC0415
    from tools.training.checkpoint import STATE_NAME, load_resume_state  # noqa: PLC0415
    rng = random.Random(SEED)
    contents = [f"{c} text".encode() for c in TEXT_STARTS] + [saved(trained())[:n] for n in (1, 3, 16, 22, 51)]
    contents += [rng.randbytes(50) for _ in range(10)]
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    cache = tmp_path / "torch_home" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    for i, content in enumerate(contents):
        (tmp_path / STATE_NAME).write_bytes(content)
        with pytest.raises(UserError, match="rerun without --resume") as error:
            load_resume_state(tmp_path, {})
        assert "\n" not in str(error.value)
        name = f"resnet18-{hashlib.sha256(content).hexdigest()[:8]}.pth"
        (cache / name).write_bytes(content)
        monkeypatch.setattr(weights.value, "url", f"https://download.invalid/{name}")
        with pytest.raises(UserError, match="delete it and rerun") as error:
            _download_weights(weights, ModelRecord())
        assert "\n" not in str(error.value), i
