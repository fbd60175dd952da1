"""`python -m tools.data provenance`: on generated JPEG data whose pairs are known (the generator's manifest), every
mixed image's background is recovered, errors and boxes equal brute-force computations, the summary's counts
equal a count of the known pairs, and two near-identical backgrounds make a doubtful match."""

from __future__ import annotations

import collections
import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import check_error, run_in_process
from tools.data import cli as data_cli
from tools.data import mixed_origins, synthetic
from tools.data.layout import MIXED, PROVENANCE_FOLDER
from tools.in9 import MASK_FOLDER, class_folder_names

CLASSES = class_folder_names()
QUALITY = 80  # JPEG quality of the generated data: the release's images went through JPEG too


def _generate(root: Path, seed: int = 5) -> synthetic.SyntheticDataset:
    return synthetic.generate(root, per_class=3, seed=seed, quality=QUALITY)


def _run(argv, capsys):
    return run_in_process(data_cli.main, [str(a) for a in argv], capsys)


def _rows(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def _stem(relpath: str) -> str:
    return Path(relpath).stem


def _pixels(root: Path, relpath: str) -> np.ndarray:
    return np.asarray(Image.open(root / relpath).convert("RGB")).astype(np.int64)


def _outside(mask: np.ndarray) -> np.ndarray:
    """The pixels farther than MASK_MARGIN (in both directions) from every foreground pixel, written as loops."""
    margin = mixed_origins.MASK_MARGIN
    far = np.ones_like(mask)
    for y, x in zip(*np.nonzero(mask)):
        far[max(0, y - margin):y + margin + 1, max(0, x - margin):x + margin + 1] = False
    return far if far.any() else ~mask


def _error(image: np.ndarray, background: np.ndarray, outside: np.ndarray) -> float:
    return float(np.abs(image - background)[outside].mean())


def _truth(dataset: synthetic.SyntheticDataset) -> dict[tuple[str, str], str]:
    """(variation, stem) -> the stem of the background the generator used."""
    return {(variation, image.stem): stem
            for image in dataset.images for variation, (stem, _) in image.mixed_bg.items()}


@pytest.fixture(scope="module")
def provenance_run(tmp_path_factory, one_thread):
    """Generated data, and what the command printed and wrote for it."""
    dataset = _generate(tmp_path_factory.mktemp("provenance") / "bg_challenge")
    out = dataset.root / PROVENANCE_FOLDER
    mixed_origins.write_provenance(mixed_origins.find_provenance(dataset.root, workers=1, progress=False), out)
    return dataset, _rows(out / mixed_origins.MATCHES_FILE), _rows(out / mixed_origins.BOXES_FILE), \
        json.loads((out / mixed_origins.SUMMARY_FILE).read_text())


@pytest.mark.slow
def test_every_pair_is_recovered_with_the_brute_force_error(provenance_run):
    dataset, rows, _, summary = provenance_run
    truth = _truth(dataset)
    assert len(rows) == 3 * len(dataset.images) == summary["mixed_images"]
    assert {(r["variation"], _stem(r["image"])) for r in rows} == set(truth)
    backgrounds = sorted(p.relative_to(dataset.root).as_posix() for p in dataset.root.glob("only_bg_t/val/*/*"))
    decoded = {relpath: _pixels(dataset.root, relpath) for relpath in backgrounds}
    outside = {i.stem: _outside(np.load(dataset.root / MASK_FOLDER / "val" / CLASSES[i.label] / f"{i.stem}.npy"))
               for i in dataset.images}
    for row in rows:
        assert _stem(row["background"]) == truth[(row["variation"], _stem(row["image"]))], row
        image = _pixels(dataset.root, row["image"])
        errors = {relpath: _error(image, pixels, outside[_stem(row["image"])]) for relpath, pixels in decoded.items()}
        ranked = sorted(errors, key=errors.get)
        assert row["background"] == ranked[0] and row["runner_up"] == ranked[1]
        assert float(row["error"]) == pytest.approx(errors[ranked[0]], abs=1e-3)
        assert float(row["runner_up_error"]) == pytest.approx(errors[ranked[1]], abs=1e-3)
        assert row["background_class"] == row["background"].split("/")[2]
        assert row["doubtful"] == "0" and float(row["ratio"]) < mixed_origins.DOUBT_RATIO


def test_boxes_are_the_masks_extents(provenance_run):
    dataset, _, boxes, summary = provenance_run
    assert [(r["class"], r["stem"]) for r in boxes] == [(CLASSES[i.label], i.stem) for i in dataset.images]
    for row in boxes:
        mask = np.load(dataset.root / row["mask"])
        rows = [y for y in range(mask.shape[0]) if any(mask[y])]
        cols = [x for x in range(mask.shape[1]) if any(mask[:, x])]
        assert [int(row[k]) for k in ("x0", "y0", "x1", "y1")] == [cols[0], rows[0], cols[-1] + 1, rows[-1] + 1]
        assert int(row["foreground_pixels"]) == int(mask.sum())
    assert summary["boxes"] == {"masks": len(dataset.images), "empty_masks": 0}


def test_the_summary_counts_equal_a_count_of_the_known_pairs(provenance_run):
    dataset, _, _, summary = provenance_run
    label = {image.stem: image.label for image in dataset.images}
    truth = _truth(dataset)
    for variation in MIXED:
        pairs = [(stem, bg) for (v, stem), bg in truth.items() if v == variation]
        uses = collections.Counter(bg for _, bg in pairs)
        row = summary["variations"][variation]
        assert row["images"] == row["matched"] == len(pairs) and row["doubtful"] == 0
        assert row["own_class"] == sum(label[bg] == label[stem] for stem, bg in pairs)
        assert row["next_class"] == sum(label[bg] == (label[stem] + 1) % 9 for stem, bg in pairs)
        assert row["own_image"] == sum(bg == stem for stem, bg in pairs)
        assert row["background_classes"] == {c: sum(CLASSES[label[bg]] == c for _, bg in pairs) for c in CLASSES}
        assert row["distinct_backgrounds"] == len(uses)
        assert row["reused_backgrounds"] == sum(1 for n in uses.values() if n > 1)
        assert row["most_uses"] == max(uses.values())
    assert summary["variations"]["mixed_same"]["own_class"] == len(dataset.images)
    assert summary["variations"]["mixed_next"]["next_class"] == len(dataset.images)
    for pair, count in summary["same_background"].items():
        first, second = pair.split("/")
        assert count == sum(truth[(first, i.stem)] == truth[(second, i.stem)] for i in dataset.images)
    uses = collections.Counter(truth.values())
    assert summary["reuse"]["distinct_backgrounds"] == len(uses)
    assert summary["reuse"]["unused_backgrounds"] == len(dataset.images) - len(uses)
    assert summary["reuse"]["uses"] == {str(n): k for n, k in sorted(collections.Counter(uses.values()).items())}


def test_two_near_identical_backgrounds_make_a_doubtful_match(tmp_path, capsys, one_thread):
    dataset = _generate(tmp_path / "bg_challenge", seed=6)
    truth = _truth(dataset)
    copied = collections.Counter(truth.values()).most_common(1)[0][0]
    label = dataset.by_stem()[copied].label
    source = dataset.root / "only_bg_t" / "val" / CLASSES[label] / f"{copied}.JPEG"
    twin = np.array(Image.open(source).convert("RGB"))
    twin[:4, :4] ^= 0x20  # the same pixels but for a 4x4 corner (background in every image), saved losslessly
    Image.fromarray(twin).save(source.with_name("twin.png"))
    code, out, err = _run(["provenance", "--data-path", dataset.root, "--output", tmp_path / "out", "--no-progress",
                           "--workers", "1"], capsys)
    assert code == 0, err
    rows = _rows(tmp_path / "out" / mixed_origins.MATCHES_FILE)
    doubtful = {(r["variation"], _stem(r["image"])) for r in rows if r["doubtful"] == "1"}
    assert doubtful == {key for key, stem in truth.items() if stem == copied}
    for row in rows:
        if (row["variation"], _stem(row["image"])) in doubtful:
            assert {_stem(row["background"]), _stem(row["runner_up"])} == {copied, "twin"}
            assert float(row["ratio"]) > mixed_origins.DOUBT_RATIO
        else:
            assert _stem(row["background"]) == truth[(row["variation"], _stem(row["image"]))]
    summary = json.loads((tmp_path / "out" / mixed_origins.SUMMARY_FILE).read_text())
    assert summary["doubtful"] == len(doubtful) and f"{len(doubtful)} doubtful" in out


def test_masks_that_leave_little_or_no_background(tmp_path, capsys, one_thread):
    """A mask grown to all but a thin frame leaves no clean thumbnail cell (the pixel search finds the
    background); a mask over the whole image leaves nothing to compare (no match, and an empty box is not)."""
    dataset = _generate(tmp_path / "bg_challenge", seed=7)
    truth = _truth(dataset)
    framed, covered = dataset.images[0], dataset.images[1]
    frame = np.ones((224, 224), bool)
    frame[5:-5, 5:-5] = False
    np.save(dataset.root / MASK_FOLDER / "val" / CLASSES[framed.label] / f"{framed.stem}.npy", ~frame)
    np.save(dataset.root / MASK_FOLDER / "val" / CLASSES[covered.label] / f"{covered.stem}.npy",
            np.ones((224, 224), bool))
    code, out, err = _run(["provenance", "--data-path", dataset.root, "--no-progress", "--workers", "1"], capsys)
    assert code == 0, err
    rows = {(r["variation"], _stem(r["image"])): r for r in
            _rows(dataset.root / PROVENANCE_FOLDER / mixed_origins.MATCHES_FILE)}
    for variation in MIXED:
        assert _stem(rows[(variation, framed.stem)]["background"]) == truth[(variation, framed.stem)]
        assert rows[(variation, covered.stem)]["background"] == rows[(variation, covered.stem)]["error"] == ""
    boxes = {r["stem"]: r for r in _rows(dataset.root / PROVENANCE_FOLDER / mixed_origins.BOXES_FILE)}
    assert [boxes[framed.stem][k] for k in ("x0", "y0", "x1", "y1")] == ["5", "5", "219", "219"]
    assert [boxes[covered.stem][k] for k in ("x0", "y0", "x1", "y1")] == ["0", "0", "224", "224"]
    summary = json.loads((dataset.root / PROVENANCE_FOLDER / mixed_origins.SUMMARY_FILE).read_text())
    assert summary["unmatched"] == 3 and "3 with no background pixel to compare" in out


def test_a_mixed_image_without_its_mask_is_one_error_line(tmp_path, capsys):
    dataset = synthetic.generate(tmp_path / "bg_challenge", per_class=1, seed=8)
    stem, cls = dataset.images[2].stem, CLASSES[dataset.images[2].label]
    shutil.copy(dataset.root / "mixed_rand" / "val" / cls / f"{stem}.JPEG",
                dataset.root / "mixed_rand" / "val" / cls / "stray.JPEG")
    code, out, err = _run(["provenance", "--data-path", dataset.root, "--no-progress"], capsys)
    line = check_error(code, out, err)
    assert f"mixed_rand/val/{cls}/stray.JPEG has no mask {MASK_FOLDER}/val/{cls}/stray.npy" in line
    assert not (dataset.root / PROVENANCE_FOLDER).exists()
    with pytest.raises(SystemExit) as exc:  # refused by the flag's parser type
        _run(["provenance", "--data-path", dataset.root, "--workers", "0"], capsys)
    assert "argument --workers: '0' is not a whole number" in check_error(exc.value.code, *capsys.readouterr())


@pytest.mark.slow
def test_letterboxed_backgrounds_that_tie_on_the_coarse_cells_are_still_told_apart(tmp_path, capsys, one_thread):
    """Backgrounds with black bars over their top rows, and masks that leave only the bars and a few rows below them:
    every clean thumbnail cell is black, so the coarse cells tie for every background, and only the pixels below
    the bars tell them apart (saved losslessly, the true background's error is 0)."""
    dataset = _generate(tmp_path / "bg_challenge", seed=9)
    truth = _truth(dataset)
    rng = np.random.default_rng(0)
    foreground = np.zeros((224, 224), bool)
    foreground[58:] = True
    backgrounds = {}
    for image in dataset.images:
        cls = CLASSES[image.label]
        picture = Image.fromarray(rng.integers(0, 256, (7, 7, 3), dtype=np.uint8)).resize((224, 224), Image.BILINEAR)
        backgrounds[image.stem] = np.array(picture)
        backgrounds[image.stem][:48] = 0
        (dataset.root / "only_bg_t" / "val" / cls / f"{image.stem}.JPEG").unlink()
        Image.fromarray(backgrounds[image.stem]).save(dataset.root / "only_bg_t" / "val" / cls / f"{image.stem}.png")
        np.save(dataset.root / MASK_FOLDER / "val" / cls / f"{image.stem}.npy", foreground)
    for (variation, stem), background in truth.items():
        folder = dataset.root / variation / "val" / CLASSES[dataset.by_stem()[stem].label]
        mixed = backgrounds[background].copy()
        mixed[foreground] = (200, 30, 30)
        (folder / f"{stem}.JPEG").unlink()
        Image.fromarray(mixed).save(folder / f"{stem}.png")
    code, out, err = _run(["provenance", "--data-path", dataset.root, "--no-progress", "--workers", "1"], capsys)
    assert code == 0, err
    rows = _rows(dataset.root / PROVENANCE_FOLDER / mixed_origins.MATCHES_FILE)
    assert len(rows) == len(truth)
    for row in rows:
        assert _stem(row["background"]) == truth[(row["variation"], _stem(row["image"]))], row
        assert float(row["error"]) == 0 and float(row["ratio"]) < mixed_origins.DOUBT_RATIO and row["doubtful"] == "0"


def test_lossless_duplicates_go_to_the_background_listed_first(tmp_path, capsys, one_thread):
    """More exact copies of one background than the search's candidates: the match is the copy listed first (in
    the layout's sorted order) and the runner-up the one listed second, equally good."""
    dataset = _generate(tmp_path / "bg_challenge", seed=14)
    truth = _truth(dataset)
    copied = collections.Counter(truth.values()).most_common(1)[0][0]
    folder = dataset.root / "only_bg_t" / "val" / CLASSES[dataset.by_stem()[copied].label]
    pixels = np.array(Image.open(folder / f"{copied}.JPEG").convert("RGB"))
    for n in range(2 * mixed_origins.CANDIDATES + 2):
        Image.fromarray(pixels).save(folder / f"{copied}_copy{n:02d}.png")  # listed right after the original
    code, out, err = _run(["provenance", "--data-path", dataset.root, "--output", tmp_path / "out", "--no-progress",
                           "--workers", "1"], capsys)
    assert code == 0, err
    first, second = f"only_bg_t/val/{folder.name}/{copied}.JPEG", f"only_bg_t/val/{folder.name}/{copied}_copy00.png"
    rows = _rows(tmp_path / "out" / mixed_origins.MATCHES_FILE)
    duplicated = [r for r in rows if truth[(r["variation"], _stem(r["image"]))] == copied]
    assert duplicated
    for row in duplicated:
        assert (row["background"], row["runner_up"]) == (first, second), row
        assert row["error"] == row["runner_up_error"] and row["doubtful"] == "1"


def test_background_class_folders_named_unlike_the_others_are_one_error_line(tmp_path, capsys):
    dataset = synthetic.generate(tmp_path / "bg_challenge", per_class=1, seed=11)
    folder = dataset.root / "only_bg_t" / "val"
    for k, cls in enumerate(CLASSES):
        (folder / cls).rename(folder / f"class{k}")
    code, out, err = _run(["provenance", "--data-path", dataset.root, "--no-progress"], capsys)
    line = check_error(code, out, err)
    assert "only_bg_t" in line and "class0" in line and CLASSES[0] in line
    assert not (dataset.root / PROVENANCE_FOLDER).exists()
