"""The ImageNet->IN-9 map and the class names agree with the reference files; the map works on a batch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.reference import REFERENCE_DIR_VARIABLE, reference_dir
from tools import in9
from tools.in9 import PredictionMap, class_names, in_to_in9_list, in_to_in9_table

RESOURCES = Path(in9.__file__).resolve().parents[1] / "resources"
CLASSES = ["dog", "bird", "vehicle", "reptile", "carnivore", "insect", "instrument", "primate", "fish"]
WNIDS = ["n02084071", "n01503061", "n04576211", "n01661091", "n02075296", "n02159955", "n03800933", "n02469914",
         "n02512053"]

def reference_map() -> dict[int, int]:
    raw = json.loads((reference_dir() / "in_to_in9.json").read_text())
    return {int(k): v for k, v in raw.items()}


@pytest.mark.parametrize("name", ["in_to_in9.json", "in9_classes.txt"])
def test_shipped_copies_are_identical_to_the_reference(name):
    assert (RESOURCES / name).read_bytes() == (reference_dir() / name).read_bytes()


def test_table_agrees_with_reference_key_by_key():
    expected = reference_map()
    assert sorted(expected) == list(range(1000))
    table = in_to_in9_table()
    assert table.shape == (1000,) and table.dtype == torch.int64
    for index in range(1000):
        assert int(table[index]) == expected[index], index


def test_table_counts():
    table = in_to_in9_table()
    assert int((table == -1).sum()) == 630
    assert int((table >= 0).sum()) == 370
    assert set(table.tolist()) == {-1, *range(9)}


def test_class_names_match_reference():
    lines = [line.split() for line in (reference_dir() / "in9_classes.txt").read_text().splitlines() if line.strip()]
    assert [name.lower() for name, _ in lines] == list(class_names())
    assert [wnid for _, wnid in lines] == WNIDS


def test_class_names():
    assert list(class_names()) == CLASSES


def _logits_with_argmax(indices: list[int], num_classes: int = 1000, device="cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(indices), num_classes, generator=gen)
    logits[torch.arange(len(indices)), torch.tensor(indices)] = 100.0
    return logits.to(device)


def _check_batch_mapping(device: str) -> None:
    expected = {int(k): v for k, v in json.loads((RESOURCES / "in_to_in9.json").read_text()).items()}
    indices = list(range(1000)) + [0, 999, 151, 500]  # every ImageNet class, some twice
    logits = _logits_with_argmax(indices, device=device)
    predictions = PredictionMap(1000)(logits)
    assert predictions.device == logits.device
    assert predictions.dtype == torch.int64
    assert predictions.cpu().tolist() == [expected[i] for i in indices]


def test_argmax_then_map_on_a_batch():
    _check_batch_mapping("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_argmax_then_map_on_a_batch_on_the_gpu():
    _check_batch_mapping("cuda")


def test_argmax_is_over_all_1000_logits():
    """An unmapped class with the top logit gives -1, even when a mapped class is a close second."""
    table = in_to_in9_table()
    unmapped, mapped = int((table == -1).nonzero()[0]), int((table == 3).nonzero()[0])
    logits = torch.zeros(1, 1000)
    logits[0, unmapped], logits[0, mapped] = 2.0, 1.999
    assert PredictionMap(1000)(logits).tolist() == [-1]
    logits[0, mapped] = 2.001
    assert PredictionMap(1000)(logits).tolist() == [3]


def test_unmapped_never_equals_a_label():
    table = in_to_in9_table()
    unmapped = (table == -1).nonzero().flatten().tolist()
    predictions = PredictionMap(1000)(_logits_with_argmax(unmapped))
    assert predictions.unique().tolist() == [-1]
    for label in range(9):
        labels = torch.full_like(predictions, label)
        assert int((predictions == labels).sum()) == 0


def test_nine_class_map_is_the_argmax():
    logits = _logits_with_argmax([0, 8, 4, 4, 2], num_classes=9)
    assert PredictionMap(9)(logits).tolist() == [0, 8, 4, 4, 2]


@pytest.mark.parametrize("num_classes", [10, 999, 1001])
def test_other_class_counts_are_refused(num_classes):
    with pytest.raises(ValueError, match="num_classes must be 9 or 1000"):
        PredictionMap(num_classes)


def test_the_map_agrees_with_imagenet_class_names():
    """The map's index order is ImageNet's sorted WordNet ids: checked through torchvision's class names."""
    import torchvision  # noqa: PLC0415

    names = torchvision.models.ResNet50_Weights.IMAGENET1K_V1.meta["categories"]
    table = in_to_in9_list()
    expected = {"tench": "fish", "goldfish": "fish", "great white shark": "fish", "golden retriever": "dog",
                "beagle": "dog", "goldfinch": "bird", "bald eagle": "bird", "mountain bike": "vehicle",
                "sports car": "vehicle", "bicycle-built-for-two": "vehicle", "green mamba": "reptile",
                "box turtle": "reptile", "tiger": "carnivore", "brown bear": "carnivore", "ladybug": "insect",
                "monarch": "insect", "violin": "instrument", "grand piano": "instrument", "chimpanzee": "primate",
                "gorilla": "primate", "pizza": None, "volcano": None}
    for name, in9_class in expected.items():
        label = table[names.index(name)]
        assert (class_names()[label] if label >= 0 else None) == in9_class, name


@pytest.mark.parametrize("ci, outcome", [(None, pytest.skip.Exception), ("true", pytest.fail.Exception),
                                         ("1", pytest.fail.Exception), ("false", pytest.skip.Exception)])
def test_missing_reference_facts_skip_and_fail_under_ci(ci, outcome, tmp_path, monkeypatch):
    monkeypatch.delenv(REFERENCE_DIR_VARIABLE, raising=False)
    monkeypatch.delenv("CI", raising=False)
    if ci is not None:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="no reference facts at .*shared/reference"):
        reference_dir(tmp_path / "clone")
    (tmp_path / "shared" / "reference").mkdir(parents=True)
    assert reference_dir(tmp_path / "clone") == tmp_path / "shared" / "reference"
    monkeypatch.setenv(REFERENCE_DIR_VARIABLE, str(tmp_path / "elsewhere"))
    with pytest.raises(outcome, match="no reference facts at .*elsewhere"):
        reference_dir(tmp_path / "clone")


@pytest.mark.slow
def test_a_fresh_clone_reads_the_reference_beside_the_repository(tmp_path):
    """A clone with a reference folder beside it (as CI has it) compares the shipped copies with that folder:
    here a copy with one class renamed, which the comparison must catch."""
    repository = Path(__file__).resolve().parents[1]
    clone = tmp_path / "clone"
    for name in ("tools", "tests"):
        shutil.copytree(repository / name, clone / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repository / "pyproject.toml", clone)
    beside = tmp_path / "shared" / "reference"
    beside.mkdir(parents=True)
    shutil.copy(RESOURCES / "in_to_in9.json", beside)
    shipped = (RESOURCES / "in9_classes.txt").read_text()
    (beside / "in9_classes.txt").write_text(shipped.replace("Dog", "Hound", 1))
    assert (beside / "in9_classes.txt").read_text() != shipped
    env = {k: v for k, v in os.environ.items() if k not in ("IN9_REFERENCE_DIR", "CI")}
    env.update(PYTHONPATH=str(clone), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                          "shipped_copies_are_identical", "tests/test_in9.py"],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert "1 failed, 1 passed" in run.stdout, run.stdout + run.stderr
    assert "in9_classes.txt" in run.stdout.split("short test summary")[-1]
