"""Masks with values other than 0 and 1: refused by default, reproduced exactly with --mask-arithmetic original."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import challenge_eval
from tests.challenge_reference import original_weight, reference_matrix
from tests.helpers import TinyCNN, run_in_process, save_torchscript
from tools.data import compositing, synthetic
from tools.in9 import IN9_MEAN, IN9_STD

VALUES = (0, 1, 2, 128, 200, 255, 256, 511)  # 256 and 511 wrap to 0 and 255 in uint8


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("masks") / "bg", per_class=2, seed=11).root


@pytest.fixture(scope="module")
def graded(plain, tmp_path_factory):
    """The same data with masks of many values: each mask's foreground pixels get one of VALUES, as int64."""
    root = Path(shutil.copytree(plain, tmp_path_factory.mktemp("graded") / "bg"))
    for i, path in enumerate(sorted((root / "fg_mask" / "val").rglob("*.npy"))):
        mask = np.load(path).astype(bool)
        values = np.where(mask, VALUES[i % len(VALUES)], 0).astype(np.int64)
        values[:8, :8] = VALUES[(i + 3) % len(VALUES)]  # and a patch of another value in a corner
        np.save(path, values)
    return root


@pytest.fixture(scope="module")
def cnn(tmp_path_factory):
    module = TinyCNN(9, seed=4).eval()
    path = tmp_path_factory.mktemp("masks-model") / "cnn9.ts"
    save_torchscript(module, path)
    return module, path


def run(capsys, data: Path, model: Path, out: Path, *extra: str):
    argv = ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint", "--device", "cpu",
            "--no-progress", "--no-cache",
            "--output-dir", str(out), "--log-level", "WARNING", *extra]
    return run_in_process(challenge_eval.main,
                          argv, capsys)


def test_original_weights_follow_the_uint8_rule():
    raw = np.array(VALUES + (1.7, 0.4), dtype=np.float64).reshape(2, 5)
    got = compositing.original_weights(raw)
    assert got.dtype == np.uint8
    # uint8(v) * 255 in uint8: 1 -> 255, 255 -> 1, 128 -> 128, 2 -> 254; floats truncate first (1.7 -> 1)
    assert got.ravel().tolist() == [(int(v) % 256) * 255 % 256 for v in raw.ravel()]
    assert torch.equal(original_weight(raw.astype(np.int64))[0], torch.from_numpy(got).float() / 255)


@pytest.mark.slow
def test_non_binary_masks_are_refused_before_the_search(capsys, graded, cnn, tmp_path):
    code, out, err = run(capsys, graded, cnn[1], tmp_path / "out")
    assert code == 2 and out == "" and "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0]
    line = errors[0]
    first = sorted((graded / "fg_mask" / "val").rglob("*.npy"))[0]
    for fact in (str(first), "values other than 0 and 1", "255 gives the foreground a weight of 1/255",
                 "> 0", "--mask-arithmetic original"):
        assert fact in line, line
    assert not (tmp_path / "out" / "challenge_state.npz").exists()


@pytest.mark.slow
def test_original_arithmetic_reproduces_the_original_formula(capsys, graded, cnn, tmp_path):
    code, out, err = run(capsys, graded, cnn[1], tmp_path / "out", "--mask-arithmetic", "original", "--full")
    assert code == 0, err
    got = np.load(tmp_path / "out" / "predictions.npy").astype(np.int64)
    expected, fg_labels, _ = reference_matrix(graded, cnn[0], IN9_MEAN, IN9_STD, weight=original_weight)
    assert np.array_equal(got, expected)
    vulnerable = int((expected != fg_labels[:, None]).any(axis=1).sum())
    assert f"Summary: {vulnerable}/{len(fg_labels)} " in out


@pytest.mark.slow
def test_binary_masks_give_the_same_numbers_under_both_arithmetics(capsys, plain, cnn, tmp_path):
    matrices = []
    for arithmetic in ("binary", "original"):
        code, _, err = run(capsys, plain, cnn[1], tmp_path / arithmetic, "--mask-arithmetic", arithmetic, "--full")
        assert code == 0, err
        matrices.append(np.load(tmp_path / arithmetic / "predictions.npy"))
    assert np.array_equal(*matrices)


def test_byte_composite_equals_the_float_blend_for_binary_masks():
    gen = torch.Generator().manual_seed(0)
    fg = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=gen)
    bg = torch.randint(0, 256, (4, 3, 16, 16), dtype=torch.uint8, generator=gen)
    mask = torch.rand(4, 16, 16, generator=gen) > 0.5
    fast = compositing.composite(fg.clone(), bg.clone(), compositing.byte_masks(mask))
    weights = torch.from_numpy(compositing.original_weights(mask.numpy())).unsqueeze(1)
    slow = compositing.blend(fg, bg, weights)
    assert torch.equal(fast.float() / 255, slow)
