"""`python -m tools.data verify` and `quick_check`: counts, and every problem reported, not just the first."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
from PIL import Image

from tests.helpers import run_in_process
from tools.data import check, synthetic
from tools.data import cli as data_cli
from tools.data.layout import list_foregrounds, list_variation
from tools.errors import UserError
from tools.in9 import MASK_FOLDER, VARIATIONS, class_folder_names

CLASSES = class_folder_names()


@pytest.fixture
def fresh(tmp_path):
    """A generated dataset (2 images per class) that the test may damage."""
    return synthetic.generate(tmp_path / "bg_challenge", per_class=2, seed=4).root


def _run_cli(argv, capsys):
    return run_in_process(data_cli.main, argv, capsys)


def test_a_good_dataset_passes_with_its_counts(dataset, capsys):
    report = check.verify_layout(dataset.root)
    assert report.ok and report.problems == []
    assert report.classes == CLASSES
    assert list(report.counts) == [*VARIATIONS, MASK_FOLDER]
    assert all(per == {cls: 4 for cls in CLASSES} for per in report.counts.values())
    assert report.images_checked == 8 * 36 and report.masks_checked == 36 and not report.decoded
    code, out, err = _run_cli(["verify", "--data-path", str(dataset.root), "--full", "--no-progress"], capsys)
    assert code == 0 and err == ""
    header, *rows = out.splitlines()[1:11]
    assert header.split() == ["variation", *CLASSES, "total"]
    assert [row.split() for row in rows] == [[name, *["4"] * 9, "36"] for name in (*VARIATIONS, MASK_FOLDER)]
    assert "288 images decoded" in out and out.rstrip().endswith("no problems found")


def test_every_problem_is_reported_at_once(fresh, capsys):
    dog, bird = CLASSES[0], CLASSES[1]
    shutil.rmtree(fresh / "no_fg")
    (fresh / "mixed_rand" / "val" / bird).rename(fresh / "mixed_rand" / "val" / "01_parrot")
    shutil.rmtree(fresh / "mixed_next" / "val" / CLASSES[8])
    Image.new("RGB", (256, 200)).save(fresh / "only_fg" / "val" / dog / "synth0_00000.JPEG")
    (fresh / "only_fg" / "val" / dog / "synth0_00001.JPEG").rename(fresh / "only_fg" / "val" / dog / "renamed.JPEG")
    (fresh / "only_bg_b" / "val" / dog / "synth0_00001.JPEG").write_bytes(b"not a jpeg")
    Image.new("RGB", (224, 224)).save(fresh / "mixed_same" / "val" / dog / "stranger.JPEG")
    (fresh / MASK_FOLDER / "val" / bird / "synth1_00000.npy").unlink()
    np.save(fresh / MASK_FOLDER / "val" / bird / "ghost.npy", np.zeros((224, 224), bool))
    np.save(fresh / MASK_FOLDER / "val" / dog / "synth0_00000.npy", np.zeros((100, 224), bool))
    np.save(fresh / MASK_FOLDER / "val" / dog / "synth0_00001.npy", np.full((224, 224), 2, np.uint8))
    (fresh / "original" / "val" / dog / "notes.txt").write_text("ignored")

    report = check.verify_layout(fresh)
    expected = [
        "no_fg/val: missing",
        "mixed_rand/val: class folders differ from those of original/val: missing 01_bird; extra 01_parrot",
        "mixed_next/val: class folders differ from those of original/val: missing 08_fish; extra none "
        "(8 class folders, expected 9)",
        "only_fg/val/00_dog: 1 image(s) not 224x224: synth0_00000.JPEG (256x200)",
        "only_bg_b/val/00_dog: 1 unreadable image(s): synth0_00001.JPEG",
        "mixed_same/val/00_dog: 3 images where original has 2",
        "fg_mask/val/01_bird: 1 original image(s) without a mask: synth1_00000",
        "fg_mask/val/01_bird: 1 mask(s) without an original image: ghost",
        "fg_mask/val/00_dog: 1 mask(s) not of shape (224, 224): synth0_00000.npy (100, 224)",
        "fg_mask/val/00_dog: 1 mask(s) with values other than 0 and 1: synth0_00001.npy (2)",
    ]
    for line in expected:
        assert any(p.startswith(line) for p in report.problems), (line, report.problems)
    assert len(report.problems) == len(expected)
    assert any("notes.txt" in note for note in report.notes)
    assert "only_fg/val: 1 image stem(s) that original does not have" in report.notes
    assert report.counts["mixed_same"][dog] == 3 and "no_fg" not in report.counts

    code, out, err = _run_cli(["verify", "--data-path", str(fresh), "--no-progress"], capsys)
    assert code == 2
    assert f"{len(expected)} problem(s):" in out and all(line in out for line in expected)
    assert err.count("\n") == 1 and err.startswith(f"error: {len(expected)} problem(s) in {fresh}")


def test_many_like_problems_read_as_one_line_with_examples(fresh):
    for path in sorted((fresh / "original" / "val").glob("*/*.JPEG")):
        Image.new("RGB", (100, 100)).save(path)
    report = check.verify_layout(fresh)
    assert len(report.problems) == 9
    assert report.problems[0] == ("original/val/00_dog: 2 image(s) not 224x224: synth0_00000.JPEG (100x100), "
                                  "synth0_00001.JPEG (100x100)")


def test_a_truncated_image_is_found_by_full_decoding_only(fresh):
    path = fresh / "original" / "val" / CLASSES[3] / "synth3_00001.JPEG"
    path.write_bytes(path.read_bytes()[:700])
    assert check.verify_layout(fresh).ok  # the header is intact
    report = check.verify_layout(fresh, full=True)
    assert report.decoded and len(report.problems) == 1
    assert report.problems[0].startswith(f"original/val/{CLASSES[3]}: 1 unreadable image(s): synth3_00001.JPEG")


def test_masks_of_other_accepted_forms_pass(fresh):
    mask_dir = fresh / MASK_FOLDER / "val" / CLASSES[2]
    np.save(mask_dir / "synth2_00000.npy", np.ones((224, 224, 1), np.uint8))
    np.save(mask_dir / "synth2_00001.npy", np.zeros((224, 224), np.float32))
    assert check.verify_layout(fresh).ok


def test_quick_check_passes_and_counts(dataset):
    assert check.quick_check(dataset.root, VARIATIONS, need_masks=True) == {
        **{name: 36 for name in VARIATIONS}, MASK_FOLDER: 36}
    assert check.quick_check(dataset.root, ["mixed_rand"]) == {"mixed_rand": 36}


def test_quick_check_raises_the_first_problem(fresh):
    shutil.rmtree(fresh / MASK_FOLDER / "val" / CLASSES[5])
    assert check.quick_check(fresh, ["original", "only_bg_t"]) == {"original": 18, "only_bg_t": 18}  # masks not needed
    with pytest.raises(UserError, match=r"fg_mask/val: class folders differ from those of original/val: missing "
                                        r"05_insect; extra none \(8 class folders, expected 9\); run `python -m "
                                        rf"tools.data verify --data-path {re.escape(str(fresh))}` for the full list"):
        check.quick_check(fresh, ["original"], need_masks=True)
    (fresh / "original" / "val" / CLASSES[0] / "synth0_00000.JPEG").unlink()
    with pytest.raises(UserError, match=r"\(and 1 more problem\(s\)\)"):
        check.quick_check(fresh, ["original"], need_masks=True)
    shutil.rmtree(fresh / "mixed_same")
    with pytest.raises(UserError, match="mixed_same/val: missing: no such folder"):
        check.quick_check(fresh, ["original", "mixed_same"])
    Image.new("RGB", (300, 300)).save(fresh / "original" / "val" / CLASSES[0] / "aaa.JPEG")  # first in its class
    with pytest.raises(UserError, match="original/val/00_dog: 1 image\\(s\\) not 224x224: aaa.JPEG"):
        check.quick_check(fresh, ["original"])


def test_quick_check_and_verify_say_what_to_do_about_a_missing_root(tmp_path):
    for verify in (lambda root: check.quick_check(root, VARIATIONS), check.verify_layout):
        with pytest.raises(UserError, match="does not exist or is not a folder.*tools.data fetch"):
            verify(tmp_path / "nowhere")


def test_class_folders_named_after_in9_classes_in_another_order_are_a_problem(fresh, capsys):
    """dog, bird, ... sort as bird, carnivore, dog, ...: the sorted position, which the scripts take as the class
    index, would call every bird a dog."""
    plain = [name.split("_", 1)[1] for name in CLASSES]
    for folder in (*VARIATIONS, MASK_FOLDER):
        for numbered, name in zip(CLASSES, plain):
            (fresh / folder / "val" / numbered).rename(fresh / folder / "val" / name)
    report = check.verify_layout(fresh)
    assert report.problems == ["original/val: class folders named after IN-9 classes sort into other indices than "
                               "theirs (bird would be class 0, IN-9's 1; carnivore would be class 1, IN-9's 4; dog "
                               "would be class 2, IN-9's 0; ...); rename them 00_dog ... 08_fish"]
    with pytest.raises(UserError, match="class folders named after IN-9 classes sort into other indices"):
        check.quick_check(fresh, ["original"])  # what both scripts run before they start
    for listing in (lambda: list_variation(fresh, "mixed_rand"), lambda: list_foregrounds(fresh)):  # training's
        with pytest.raises(UserError, match="class folders named after IN-9 classes sort into other indices"):
            listing()
    for numbered, name in zip(CLASSES, plain):  # named in IN-9 order, the same names are fine
        for folder in (*VARIATIONS, MASK_FOLDER):
            (fresh / folder / "val" / name).rename(fresh / folder / "val" / f"{numbered[:2]}{name}")
    assert check.verify_layout(fresh).ok


def test_verify_checks_the_split_it_is_given(tmp_path, capsys):
    """`build --split train` writes <variation>/train/...: `verify --split train` checks it, and finds its problems."""
    root = synthetic.generate(tmp_path / "train_set", per_class=1, seed=5, split="train").root
    code, out, err = _run_cli(["verify", "--data-path", str(root), "--split", "train", "--no-progress"], capsys)
    assert code == 0 and out.rstrip().endswith("no problems found"), err
    assert out.splitlines()[2].split() == ["original", *["1"] * 9, "9"]
    (root / "only_fg" / "train" / CLASSES[2] / "synth2_00000.JPEG").write_bytes(b"not a jpeg")
    code, out, err = _run_cli(["verify", "--data-path", str(root), "--split", "train", "--no-progress"], capsys)
    assert code == 2 and f"only_fg/train/{CLASSES[2]}: 1 unreadable image(s): synth2_00000.JPEG" in out
    code, out, err = _run_cli(["verify", "--data-path", str(root), "--no-progress"], capsys)  # val: not there
    assert code == 2 and "original/val: missing" in out
