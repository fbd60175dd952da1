"""`python -m tools.data build`: exact pixels in every variation, the paper's filters, box files, GrabCut."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torchvision import transforms

from tests.helpers import run_in_process, signal_when_ready
from tools.data import boxes, builder, check, layout, synthetic
from tools.data import builder as data_build
from tools.data import cli as data_cli
from tools.data.layout import list_foregrounds, list_variation
from tools.errors import UserError
from tools.in9 import MASK_FOLDER, VARIATIONS, class_folder_names

CLASSES = class_folder_names()

# Three image sizes, each with a box in original pixels and that box in the 224 crop, worked out by hand
# from Resize(256) + CenterCrop(224) (half-open boxes; a box edge off the pixel grid is rounded outwards).
CASES = {
    # 512x600 -> 256x300 (scale 1/2), crop offset (16, 38): x 100*0.5-16=34, 300*0.5-16=134; y 120*0.5-38=22,
    # 400*0.5-38=162.
    "a": ((512, 600), (100, 120, 300, 400), (34, 22, 134, 162)),
    # 300x260 -> 295x256 (x scale 295/300, y scale 256/260), offset (round(35.5)=36, 16): x 60*295/300-36=23,
    # 240*295/300-36=200; y 40*256/260-16=23.38 -> 23, 220*256/260-16=200.6 -> 201.
    "b": ((300, 260), (60, 40, 240, 220), (23, 23, 200, 201)),
    # 224x224 -> 256x256 (scale 8/7), offset (16, 16): x 21*8/7-16=8, 133*8/7-16=136; y 35*8/7-16=24, 161*8/7-16=168.
    "c": ((224, 224), (21, 35, 133, 161), (8, 24, 136, 168)),
}


def _picture(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """A smooth coloured pattern with a little noise (smooth, so JPEG stays close to it)."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(60, 190, size=3)
    wave = 45 * np.sin(xx / rng.uniform(8, 16) + yy / rng.uniform(10, 22))[..., None] * rng.uniform(0.5, 1, size=3)
    noise = rng.normal(0, 3, (height, width, 3))
    return np.clip(base + wave + noise, 0, 255).astype(np.uint8)


def _ellipse(shape: tuple[int, int], box) -> np.ndarray:
    x0, y0, x1, y1 = box
    yy, xx = np.mgrid[0:shape[0], 0:shape[1]] + 0.5
    return ((xx - (x0 + x1) / 2) / ((x1 - x0) / 2)) ** 2 + ((yy - (y0 + y1) / 2) / ((y1 - y0) / 2)) ** 2 <= 1


def _torchvision_crop(path: Path) -> np.ndarray:
    """The reference pipeline: torchvision's Resize(256) and CenterCrop(224) on the PIL image."""
    with Image.open(path) as img:
        return np.asarray(transforms.CenterCrop(224)(transforms.Resize(256)(img.convert("RGB"))))


def _nearest(mask: np.ndarray, resized: tuple[int, int], offset: tuple[int, int]) -> np.ndarray:
    """Nearest-neighbour resize (sampling at pixel centres) and crop: crop pixel (y, x) takes the source pixel
    under the centre of resized pixel (offset_y + y, offset_x + x)."""
    height, width = mask.shape
    rows = [int((offset[1] + y + 0.5) * height / resized[1]) for y in range(224)]
    cols = [int((offset[0] + x + 0.5) * width / resized[0]) for x in range(224)]
    return mask[np.ix_(rows, cols)]


def _tiled(image: np.ndarray, box) -> np.ndarray:
    """only_bg_t written out: the largest full strip outside the box (first of top, bottom, left, right on a
    tie), repeated over the box from its first row (or column)."""
    x0, y0, x1, y1 = box
    size = image.shape[0]
    strips = [(y0 * size, "rows", 0, y0), ((size - y1) * size, "rows", y1, size),
              (x0 * size, "cols", 0, x0), ((size - x1) * size, "cols", x1, size)]
    best = strips[0]
    for strip in strips[1:]:
        if strip[0] > best[0]:
            best = strip
    _, axis, start, stop = best
    out = image.copy()
    if axis == "rows":
        for y in range(y0, y1):  # box row y takes strip row start + (y - y0) mod the strip's height
            out[y, x0:x1] = image[start + (y - y0) % (stop - start), x0:x1]
    else:
        for x in range(x0, x1):
            out[y0:y1, x] = image[y0:y1, start + (x - x0) % (stop - start)]
    return out


@dataclass
class Expected:
    label: int
    crop: np.ndarray
    box: tuple
    mask: np.ndarray


@dataclass
class Inputs:
    images: Path
    boxes: Path
    masks: Path
    expected: dict[str, Expected]  # "class/stem" -> what build must produce


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Inputs:
    """Two images per class, of two of the sizes a, b, c in turn, one box each; masks given: for a and c at
    the original size (.npy), for b already cropped to 224 (.png)."""
    root = tmp_path_factory.mktemp("inputs")
    rng = np.random.default_rng(7)
    rows, expected = ["image,xmin,ymin,xmax,ymax"], {}
    (root / "masks").mkdir()
    for label, cls in enumerate(CLASSES):
        (root / "images" / cls).mkdir(parents=True)
        for case in ("ab", "bc", "ca")[label % 3]:
            (width, height), box, crop_box = CASES[case]
            stem = f"n{label}_{case}"
            path = root / "images" / cls / (f"{stem}.png" if case == "b" else f"{stem}.JPEG")
            Image.fromarray(_picture(rng, width, height)).save(path, quality=90)
            rows.append(f"{path.name},{','.join(map(str, box))}")
            crop = _torchvision_crop(path)
            if case == "b":
                mask = _ellipse((224, 224), (crop_box[0] + 10, crop_box[1] + 5, crop_box[2] - 20, crop_box[3]))
                Image.fromarray(mask.astype(np.uint8) * 255).save(root / "masks" / f"{stem}.png")
            else:
                original = _ellipse((height, width), box)
                np.save(root / "masks" / f"{stem}.npy", original)
                resized, offset = ((256, 300), (16, 38)) if case == "a" else ((256, 256), (16, 16))
                mask = _nearest(original, resized, offset)
            expected[f"{cls}/{stem}"] = Expected(label, crop, crop_box, mask)
    (root / "boxes.csv").write_text("\n".join(rows) + "\n")
    return Inputs(root / "images", root / "boxes.csv", root / "masks", expected)


def _expected_variation(inputs: Inputs, summary_row: dict, name: str) -> np.ndarray:
    e = inputs.expected[summary_row["image"]]
    on = e.mask[..., None]
    if name == "original":
        return e.crop
    if name == "only_fg":
        return np.where(on, e.crop, 0)
    if name == "no_fg":
        return np.where(on, 0, e.crop)
    if name == "only_bg_b":
        x0, y0, x1, y1 = e.box
        out = e.crop.copy()
        out[y0:y1, x0:x1] = 0
        return out
    if name == "only_bg_t":
        return _tiled(e.crop, e.box)
    other = inputs.expected[summary_row[name]]
    return np.where(on, e.crop, _tiled(other.crop, other.box))


def _run_cli(argv, capsys):
    return run_in_process(data_cli.main, argv, capsys)


def test_crop_geometry_matches_torchvision_resize_and_center_crop(tmp_path):
    rng = np.random.default_rng(0)
    for width, height in [(333, 517), (500, 375), (257, 1000), (1000, 257), (224, 224), (256, 300), (301, 256)]:
        path = tmp_path / f"{width}x{height}.png"
        Image.fromarray(_picture(rng, width, height)).save(path)
        with Image.open(path) as img:
            ours = boxes.CropGeometry.for_image(width, height).image(img.convert("RGB"))
        np.testing.assert_array_equal(ours, _torchvision_crop(path))


@pytest.fixture(scope="module")
def built_png(inputs, tmp_path_factory) -> tuple[Path, builder.BuildResult]:
    """The inputs built losslessly (PNG), seed 5."""
    out = tmp_path_factory.mktemp("built") / "png"
    return out, builder.build(inputs.images, inputs.boxes, out, masks=inputs.masks, seed=5, image_format="png",
                           progress=False)


@pytest.mark.slow
def test_every_variation_has_exactly_the_expected_pixels(inputs, built_png):
    out, result = built_png
    summary = json.loads((out / builder.SUMMARY_NAME).read_text())
    assert summary["kept"] == len(inputs.expected) == 18 and sum(summary["dropped"].values()) == 0
    assert summary == result.summary()
    for row in summary["images"]:
        e = inputs.expected[row["image"]]
        assert tuple(row["box"]) == e.box
        cls, stem = row["image"].split("/")
        np.testing.assert_array_equal(np.load(out / MASK_FOLDER / "val" / cls / f"{stem}.npy"), e.mask)
        for name in VARIATIONS:
            with Image.open(out / name / "val" / cls / f"{stem}.png") as img:
                written = np.asarray(img)
            np.testing.assert_array_equal(written, _expected_variation(inputs, row, name), err_msg=f"{name} {stem}")
        same, rand, nxt = (inputs.expected[row[v]] for v in layout.MIXED)
        assert same.label == e.label and row["mixed_same"] != row["image"]
        assert nxt.label == (e.label + 1) % 9 and row["mixed_rand"] != row["image"]
    assert len({row["mixed_rand"].split("/")[0] for row in summary["images"]}) > 3  # classes vary


def test_variation_arrays_follow_the_definitions(inputs):
    e = next(iter(inputs.expected.values()))
    other = list(inputs.expected.values())[4]
    background = _tiled(other.crop, other.box)
    arrays = data_build.variation_arrays(e.crop, e.box, e.mask, {"mixed_rand": background})
    row = {"image": next(iter(inputs.expected)), "mixed_rand": list(inputs.expected)[4]}
    assert set(arrays) == {"original", "only_fg", "only_bg_b", "only_bg_t", "no_fg", "mixed_rand"}
    for name, array in arrays.items():
        assert array.dtype == np.uint8 and array.shape == (224, 224, 3)
        np.testing.assert_array_equal(array, _expected_variation(inputs, row, name), err_msg=name)


def test_cli_build_writes_the_release_layout_as_jpeg(inputs, built_png, tmp_path, capsys):
    out = tmp_path / "built"
    code, stdout, err = _run_cli(["build", "--images", str(inputs.images), "--boxes", str(inputs.boxes), "--out",
                                  str(out), "--masks", str(inputs.masks), "--seed", "5", "--no-progress"], capsys)
    assert code == 0, err
    assert f"built {out} from 18 images: kept 18, dropped 0" in stdout
    summary = json.loads((out / builder.SUMMARY_NAME).read_text())
    assert summary["images"] == built_png[1].summary()["images"]  # the same seed: the same boxes and backgrounds
    for name in VARIATIONS:
        records = list_variation(out, name)
        assert len(records) == 18 and all(r.relpath.endswith(".JPEG") for r in records)
    assert len(list_foregrounds(out)) == 18
    report = check.verify_layout(out)
    assert report.ok, report.problems
    for row in summary["images"][:6]:
        cls, stem = row["image"].split("/")
        for name in VARIATIONS:
            with Image.open(out / name / "val" / cls / f"{stem}.JPEG") as img:
                written = np.asarray(img).astype(int)
            error = np.abs(written - _expected_variation(inputs, row, name)).mean()
            assert error < 3, (name, stem, error)


def _filter_inputs(root: Path, skip_class: int | None = None) -> tuple[Path, Path, Path]:
    """One good image per class, plus in class 0 an image for each reason to drop one."""
    rng = np.random.default_rng(3)
    images, masks = root / "images", root / "masks"
    masks.mkdir(parents=True)
    rows = ["image,xmin,ymin,xmax,ymax"]

    def add(label: int, stem: str, size: tuple[int, int], box_rows, mask_box=None):
        (images / CLASSES[label]).mkdir(parents=True, exist_ok=True)
        Image.fromarray(_picture(rng, *size)).save(images / CLASSES[label] / f"{stem}.JPEG")
        rows.extend(f"{stem}.JPEG,{','.join(map(str, b))}" for b in box_rows)
        if mask_box is not None:
            np.save(masks / f"{stem}.npy", _ellipse(size[::-1], mask_box))

    for label in range(9):
        if label != skip_class:
            add(label, f"good{label}", (300, 260), [(60, 40, 240, 220)], (60, 40, 240, 220))
        else:
            (images / CLASSES[label]).mkdir(parents=True)
    add(0, "no_box", (300, 260), [], (60, 40, 240, 220))
    add(0, "two_boxes", (300, 260), [(60, 40, 240, 220), (10, 10, 50, 50)], (60, 40, 240, 220))
    add(0, "empty_box", (300, 260), [(60, 40, 60, 220)], (60, 40, 240, 220))
    add(0, "giant", (512, 600), [(0, 0, 512, 600)], (0, 0, 512, 600))
    # 600x256 keeps its size; the crop takes columns 188..411, so 12 of the box's 200 columns are inside
    add(0, "outside", (600, 256), [(0, 50, 200, 150)], (0, 50, 200, 150))
    add(0, "no_mask", (300, 260), [(60, 40, 240, 220)])
    add(0, "tiny_mask", (300, 260), [(60, 40, 240, 220)], (140, 120, 160, 140))  # about 2% of the box
    (root / "boxes.csv").write_text("\n".join(rows) + "\n")
    return images, root / "boxes.csv", masks


def test_filters_drop_what_the_paper_drops_and_count_it(tmp_path, capsys):
    images, box_file, masks = _filter_inputs(tmp_path / "in")
    out = tmp_path / "built"
    code, stdout, err = _run_cli(["build", "--images", str(images), "--boxes", str(box_file), "--out", str(out),
                                  "--masks", str(masks), "--no-progress", "--image-format", "png"], capsys)
    assert code == 0, err
    summary = json.loads((out / builder.SUMMARY_NAME).read_text())
    dog = CLASSES[0]
    assert summary["dropped_images"] == {
        "no_box": [f"{dog}/no_box"], "several_boxes": [f"{dog}/two_boxes"], "empty_box": [f"{dog}/empty_box"],
        "box_too_large": [f"{dog}/giant"], "box_outside_crop": [f"{dog}/outside"], "no_mask": [f"{dog}/no_mask"],
        "small_foreground": [f"{dog}/tiny_mask"]}
    assert summary["input_images"] == 16 and summary["kept"] == 9
    assert summary["dropped"]["unreadable"] == 0 and summary["dropped"]["grabcut_failed"] == 0
    assert summary["kept_per_class"] == {cls: 1 for cls in CLASSES}
    assert "kept 9, dropped 7" in stdout and "dropped, box_outside_crop: 1" in stdout
    # one image per class: mixed_same falls back to the image's own background, and says so
    assert len(summary["mixed_same_fallbacks"]) == 9 and "own background" in stdout
    for row in summary["images"]:
        assert row["mixed_same"] == row["image"]
        assert row["mixed_next"] == f"{CLASSES[(row['label'] + 1) % 9]}/good{(row['label'] + 1) % 9}"
    assert check.verify_layout(out).ok


def test_another_seed_picks_other_backgrounds(built_png):
    _, result = built_png
    other = copy.deepcopy(result)
    data_build._choose_backgrounds(other, seed=6)
    assert [k.backgrounds for k in other.kept] != [k.backgrounds for k in result.kept]


def test_a_class_with_nothing_kept_is_an_error_and_nothing_is_written(tmp_path):
    images, box_file, masks = _filter_inputs(tmp_path / "in", skip_class=4)
    out = tmp_path / "built"
    with pytest.raises(UserError, match=f"no image of class.*{CLASSES[4]}.*nothing was written"):
        builder.build(images, box_file, out, masks=masks, progress=False)
    assert not out.exists()


def test_an_output_folder_in_use_is_refused(inputs, tmp_path):
    out = tmp_path / "built"
    out.mkdir()
    (out / "something").write_text("x")
    with pytest.raises(UserError, match="not an empty folder; build never overwrites"):
        builder.build(inputs.images, inputs.boxes, out, masks=inputs.masks, progress=False)


def test_without_opencv_and_masks_the_error_names_both_ways_out(inputs, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cv2", None)  # import cv2 now raises ImportError
    out = tmp_path / "built"
    code, _, err = _run_cli(["build", "--images", str(inputs.images), "--boxes", str(inputs.boxes), "--out", str(out),
                             "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert "pip install opencv-python-headless" in err and "--masks DIR" in err
    assert not out.exists()


def test_a_mask_of_the_wrong_size_is_a_user_error(inputs, tmp_path):
    masks = tmp_path / "masks"
    masks.mkdir()
    for path in inputs.masks.iterdir():
        (masks / path.name).write_bytes(path.read_bytes())
    np.save(masks / "n0_a.npy", np.ones((100, 100), bool))
    with pytest.raises(UserError, match=r"mask .*n0_a.npy has shape \(100, 100\); it must match its image "
                                        r"\(600, 512\) or be already cropped \(224, 224\)"):
        builder.build(inputs.images, inputs.boxes, tmp_path / "built", masks=masks, progress=False)


def _voc(path: Path, filename: str, size, objects) -> None:
    boxes_xml = "".join(f"<object><name>n0</name><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}</ymin><xmax>{b[2]}</xmax>"
                        f"<ymax>{b[3]}</ymax></bndbox></object>" for b in objects)
    size_xml = f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>" if size else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<annotation><folder>x</folder><filename>{filename}</filename>{size_xml}{boxes_xml}</annotation>")


def test_voc_boxes_are_one_based_inclusive_and_keyed_by_the_file_name(tmp_path):
    folder = tmp_path / "Annotation"
    _voc(folder / "n01" / "img_1.xml", "%s", (300, 260), [(61, 41, 240, 220)])  # ImageNet's placeholder filename
    _voc(folder / "n02" / "img_2.xml", "img_2", (300, 260), [(1, 1, 10, 10), (20, 20, 30, 30)])
    _voc(folder / "img_3.xml", "img_3", (600, 520), [(121, 81, 480, 440)])  # declared at twice the size
    _voc(folder / "img_4.xml", "img_4", None, [(0, 5, 10, 15)])  # a 0 where VOC means 1: clipped
    entries = boxes.read_boxes(folder)
    assert entries["img_1"].boxes_for(300, 260) == [(60, 40, 240, 220)]
    assert len(entries["img_2"].boxes) == 2
    assert entries["img_3"].boxes_for(300, 260) == [(60, 40, 240, 220)]
    assert entries["img_4"].boxes_for(50, 50) == [(0, 4, 10, 15)]


def test_box_file_mistakes_are_user_errors(tmp_path):
    (tmp_path / "bad.csv").write_text("file,x0,y0,x1,y1\na,1,2,3,4\n")
    with pytest.raises(UserError, match="lacks the column.*image,xmin,ymin,xmax,ymax"):
        boxes.read_boxes(tmp_path / "bad.csv")
    (tmp_path / "nan.csv").write_text("image,xmin,ymin,xmax,ymax\na.JPEG,1,2,three,4\n")
    with pytest.raises(UserError, match="line 2: the coordinates must be finite numbers"):
        boxes.read_boxes(tmp_path / "nan.csv")
    (tmp_path / "voc").mkdir()
    (tmp_path / "voc" / "a.xml").write_text("<annotation><object>")
    with pytest.raises(UserError, match="a.xml is not valid XML"):
        boxes.read_boxes(tmp_path / "voc")
    with pytest.raises(UserError, match="neither a folder of Pascal VOC"):
        boxes.read_boxes(tmp_path / "boxes.txt")


def _disc_scene(rng: np.random.Generator, size: int = 224, center=(112, 112), radius: int = 50):
    """A bright disc on a dark textured background, and the disc's mask."""
    yy, xx = np.mgrid[0:size, 0:size]
    disc = (xx - center[0]) ** 2 + (yy - center[1]) ** 2 <= radius ** 2
    background = np.clip(rng.normal(45, 18, (size, size, 3)) + 25 * np.sin(xx / 5)[..., None], 0, 255)
    foreground = np.clip(rng.normal(215, 12, (size, size, 3)), 0, 255)
    return np.where(disc[..., None], foreground, background).astype(np.uint8), disc


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / (a | b).sum())


def test_grabcut_recovers_a_high_contrast_disc():
    pytest.importorskip("cv2")
    from tools.data import grabcut  # noqa: PLC0415

    image, disc = _disc_scene(np.random.default_rng(0))
    mask = grabcut.grabcut_mask(image, (52, 52, 172, 172))
    assert mask.dtype == bool and _iou(mask, disc) > 0.8
    np.testing.assert_array_equal(mask, grabcut.grabcut_mask(image, (52, 52, 172, 172)))  # seeded: repeatable
    with pytest.raises(ValueError, match="covers the whole image"):
        grabcut.grabcut_mask(image, (0, 0, 224, 224))


def test_a_build_with_grabcut_and_voc_boxes_passes_verify(tmp_path, capsys):
    pytest.importorskip("cv2")
    rng = np.random.default_rng(1)
    images, annotations = tmp_path / "images", tmp_path / "Annotation"
    discs = {}
    for label, cls in enumerate(CLASSES):
        (images / cls).mkdir(parents=True)
        for i in range(1):
            stem = f"d{label}_{i}"
            center = (int(rng.integers(90, 134)), int(rng.integers(90, 134)))
            image, discs[stem] = _disc_scene(rng, center=center, radius=int(rng.integers(35, 55)))
            Image.fromarray(image).save(images / cls / f"{stem}.JPEG", quality=95)
            ys, xs = np.nonzero(discs[stem])
            box = (xs.min() - 8, ys.min() - 8, xs.max() + 9, ys.max() + 9)  # half-open, a margin around the disc
            _voc(annotations / f"{stem}.xml", stem, (224, 224), [(box[0] + 1, box[1] + 1, box[2], box[3])])
    out = tmp_path / "built"
    code, stdout, err = _run_cli(["build", "--images", str(images), "--boxes", str(annotations), "--out", str(out),
                                  "--no-progress"], capsys)
    assert code == 0, err
    assert "kept 9, dropped 0" in stdout
    code, stdout, _ = _run_cli(["verify", "--data-path", str(out), "--full", "--no-progress"], capsys)
    assert code == 0 and "no problems found" in stdout
    geometry = boxes.CropGeometry.for_image(224, 224)
    for record in list_foregrounds(out):
        expected = geometry.mask(discs[record.stem])
        assert _iou(np.load(out / record.mask_relpath), expected) > 0.8, record.stem


@pytest.mark.slow
def test_a_built_dataset_runs_through_both_scripts(inputs, tmp_path, capsys, color_ts):
    """The build's output feeds in9_eval.py and challenge_eval.py unchanged, with the reference's numbers."""
    import challenge_eval  # noqa: PLC0415 (the scripts live at the repository root)
    import in9_eval  # noqa: PLC0415
    from tests.challenge_reference import reference_matrix, reference_verdicts  # noqa: PLC0415
    from tests.reference import evaluate as reference_evaluate  # noqa: PLC0415
    from tools.in9 import IN9_MEAN, IN9_STD  # noqa: PLC0415

    out = tmp_path / "built"
    code, _, err = _run_cli(["build", "--images", str(inputs.images), "--boxes", str(inputs.boxes), "--out", str(out),
                             "--masks", str(inputs.masks), "--no-progress"], capsys)
    assert code == 0, err
    model = synthetic.ColorEvidenceModel(9).eval()  # what color_ts[9] holds
    common = ["--data-path", str(out), "--checkpoint", str(color_ts[9]), "--trust-checkpoint", "--device", "cpu",
              "--no-progress",
              "--output-dir", str(tmp_path / "runs")]
    code = in9_eval.main(["--eval-dataset", "all", *common])
    stdout = capsys.readouterr().out
    assert code == 0
    for name in VARIATIONS:
        expected = reference_evaluate(model, out, name, 9)
        assert f"Accuracy on {name} is {100 * expected.correct / expected.total:.2f}%" in stdout
    code = challenge_eval.main([*common, "--no-cache"])
    stdout = capsys.readouterr().out
    assert code == 0
    matrix, fg_labels, bg_labels = reference_matrix(out, model, IN9_MEAN, IN9_STD)
    vulnerable = reference_verdicts(matrix, fg_labels, bg_labels, "any")
    assert f"Summary: {vulnerable.sum()}/{len(vulnerable)} " in stdout


# ----------------------------------------------------------------------------------------------------------
# Training data: --split train, ImageNet-style folders, images without boxes

@pytest.mark.slow
def test_split_train_writes_the_training_layout_that_train_py_reads(inputs, tmp_path, capsys):
    out = tmp_path / "train_set"
    code, stdout, err = _run_cli(["build", "--images", str(inputs.images), "--boxes", str(inputs.boxes), "--out",
                                  str(out), "--masks", str(inputs.masks), "--split", "train", "--image-format", "png",
                                  "--no-progress"], capsys)
    assert code == 0, err
    assert not (out / "original" / "val").exists()
    for name in VARIATIONS:
        assert len(list_variation(out, name, "train")) == len(inputs.expected)
    foregrounds = list_foregrounds(out, "train")
    assert {f"{CLASSES[f.label]}/{f.stem}" for f in foregrounds} == set(inputs.expected)
    e = inputs.expected[f"{CLASSES[foregrounds[0].label]}/{foregrounds[0].stem}"]
    with Image.open(out / foregrounds[0].image_relpath) as img:  # the same pixels as the val build
        np.testing.assert_array_equal(np.asarray(img), e.crop)
    code, _, err = _run_cli(["build", "--images", str(inputs.images), "--boxes", str(inputs.boxes), "--out",
                             str(tmp_path / "x"), "--masks", str(inputs.masks), "--keep-unboxed"], capsys)
    assert code == 2 and "use it with --split train" in err.splitlines()[-1]


def _imagenet_folder(inputs, root: Path) -> tuple[Path, dict[str, int]]:
    """1000 WordNet-id folders (fake ids, sorted like ImageNet's); the inputs' images of IN-9 class c go into
    the first ImageNet class that the map sends to c, and one image into a class of no IN-9 class."""
    table = json.loads((Path(__file__).resolve().parents[1] / "tools" / "resources" / "in_to_in9.json").read_text())
    wnids = [f"n{10000000 + 7 * i:08d}" for i in range(1000)]
    first = {c: min(int(k) for k, v in table.items() if v == c) for c in range(9)}
    outside = min(int(k) for k, v in table.items() if v == -1)
    for wnid in wnids:
        (root / wnid).mkdir(parents=True)
    expected = {}
    for key in inputs.expected:
        cls, stem = key.split("/")
        label = CLASSES.index(cls)
        (source,) = (inputs.images / cls).glob(f"{stem}.*")
        shutil.copy(source, root / wnids[first[label]] / source.name)
        expected[stem] = label
    stray = next((inputs.images / CLASSES[0]).iterdir())
    shutil.copy(stray, root / wnids[outside] / f"outside{stray.suffix}")
    return root, expected


def test_an_imagenet_style_folder_is_grouped_into_the_nine_classes(inputs, tmp_path, capsys):
    images, expected = _imagenet_folder(inputs, tmp_path / "imagenet")
    out = tmp_path / "grouped"
    code, _, err = _run_cli(["build", "--images", str(images), "--boxes", str(inputs.boxes), "--out", str(out),
                             "--masks", str(inputs.masks), "--split", "train", "--no-progress"], capsys)
    assert code == 0, err
    records = list_variation(out, "original", "train")
    assert {r.stem: r.label for r in records} == expected  # the image of no IN-9 class is left out
    assert sorted(p.name for p in (out / "original" / "train").iterdir()) == class_folder_names()
    shutil.rmtree(images / "n10006993")
    code, _, err = _run_cli(["build", "--images", str(images), "--boxes", str(inputs.boxes), "--out",
                             str(tmp_path / "y"), "--masks", str(inputs.masks)], capsys)
    assert code == 2 and "needs all 1000 of ImageNet's" in err.splitlines()[-1]


@pytest.mark.slow
def test_keep_unboxed_puts_images_without_a_box_in_original_only(inputs, tmp_path, capsys):
    rows = inputs.boxes.read_text().splitlines()
    unboxed = rows[1].split(",")[0]
    (tmp_path / "boxes.csv").write_text("\n".join([rows[0], *rows[2:]]) + "\n")
    out = tmp_path / "in9l"
    code, stdout, err = _run_cli(["build", "--images", str(inputs.images), "--boxes", str(tmp_path / "boxes.csv"),
                                  "--out", str(out), "--masks", str(inputs.masks), "--split", "train",
                                  "--keep-unboxed", "--no-progress"], capsys)
    assert code == 0, err
    stem = Path(unboxed).stem
    assert stem in {r.stem for r in list_variation(out, "original", "train")}
    assert stem not in {r.stem for r in list_variation(out, "only_fg", "train")}
    assert not list((out / "fg_mask" / "train").rglob(f"{stem}.npy"))
    summary = json.loads((out / builder.SUMMARY_NAME).read_text())
    assert len(summary["unboxed_in_original"]) == 1 and summary["dropped"]["no_box"] == 0
    assert "without a box, in original/ only (--keep-unboxed): 1" in stdout
    # verify --split train checks it; the image the summary lists in original alone is expected there, and only it
    code, stdout, err = _run_cli(["verify", "--data-path", str(out), "--split", "train", "--no-progress"], capsys)
    assert code == 0 and stdout.rstrip().endswith("no problems found"), stdout
    assert "note: original/train: 1 image(s) without a box, in original/ alone (build --keep-unboxed)" in stdout
    (out / "only_fg" / "train" / summary["images"][0]["image"]).with_suffix(".JPEG").unlink()
    code, stdout, _ = _run_cli(["verify", "--data-path", str(out), "--split", "train", "--no-progress"], capsys)
    assert code == 2 and "only_fg/train/" in stdout


# ----------------------------------------------------------------------------------------------------------
# Class folders are matched to the IN-9 classes by name, never by their sorted order

WORDNET_IDS = ["n02084071", "n01503061", "n04576211", "n01661091", "n02075296", "n02159955", "n03800933",
               "n02469914", "n02512053"]  # the nine ancestor synsets, in IN-9 order (shared/reference)


@pytest.fixture(scope="module")
def coloured(tmp_path_factory) -> tuple[Path, Path, Path, dict[str, int]]:
    """(originals by class, boxes.csv, masks, stem -> true IN-9 label) from the generator, two images per class:
    the colour model knows their classes from their colours."""
    source = synthetic.generate(tmp_path_factory.mktemp("coloured") / "data", per_class=2, seed=11)
    originals = source.root / "original" / "val"
    masks = source.root / MASK_FOLDER / "val"
    rows = ["image,xmin,ymin,xmax,ymax"] + [f"{img.stem}.JPEG,{','.join(map(str, img.box))}" for img in source.images]
    boxes_csv = source.root / "boxes.csv"
    boxes_csv.write_text("\n".join(rows) + "\n")
    return originals, boxes_csv, masks, {img.stem: img.label for img in source.images}


def _images_named(coloured, root: Path, names: list[str]) -> Path:
    """The coloured originals of class c in a folder named names[c]."""
    originals, _, _, truth = coloured
    for label, name in enumerate(names):
        (root / name).mkdir(parents=True)
        for stem in (s for s, c in truth.items() if c == label):
            shutil.copy(originals / CLASSES[label] / f"{stem}.JPEG", root / name)
    return root


@pytest.mark.parametrize("names", [
    ["dog", "bird", "vehicle", "reptile", "carnivore", "insect", "instrument", "primate", "fish"],
    ["Dog", WORDNET_IDS[1], "02_vehicle", "REPTILE", WORDNET_IDS[4], "05_insect", "instrument", "Primate",
     WORDNET_IDS[8]],
], ids=["plain", "every form"])
@pytest.mark.slow
def test_class_folders_are_matched_to_the_in9_classes_by_name(coloured, names, tmp_path, capsys):
    from tests.reference import evaluate as reference_evaluate  # noqa: PLC0415

    _, boxes_csv, masks, truth = coloured
    images = _images_named(coloured, tmp_path / "images", names)
    out = tmp_path / "built"
    code, _, err = _run_cli(["build", "--images", str(images), "--boxes", str(boxes_csv), "--out", str(out),
                             "--masks", str(masks), "--image-format", "png", "--no-progress"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (out / "original" / "val").iterdir()) == CLASSES  # sorted order = IN-9 order
    records = list_variation(out, "original")
    assert {r.stem: r.label for r in records} == truth
    model = synthetic.ColorEvidenceModel(9).eval()
    result = reference_evaluate(model, out, "original", 9)  # labels from the folders' sorted positions
    correct_by_truth = sum(p == truth[path.stem] for p, path in zip(result.predictions, result.paths))
    assert result.correct == correct_by_truth >= 16  # the model knows these colours: the labels are the truth


def test_class_folders_that_name_no_in9_class_are_refused_in_one_line(coloured, tmp_path, capsys):
    _, boxes_csv, masks, _ = coloured
    names = ["dog", "bird", "car", "reptile", "carnivore", "insect", "instrument", "primate", "fish"]
    vehicle = names.index("car")
    cases = {  # name: (class folders, what the error must name)
        "unknown": (names, "car"),
        "missing": (names[:vehicle] + names[vehicle + 1:], "no folder for vehicle"),
        "twice": ([*names[:vehicle], "vehicle", *names[vehicle + 1:], "00_dog"], "00_dog"),
        "numbered wrongly": ([*names[:vehicle], "05_vehicle", *names[vehicle + 1:]], "05_vehicle"),
    }
    for case, (folders, named) in cases.items():
        images = _images_named(coloured, tmp_path / case, [f for f in folders if f != "00_dog"])
        if "00_dog" in folders:
            shutil.copytree(images / "dog", images / "00_dog")
        out = tmp_path / f"out-{case}"
        code, stdout, err = _run_cli(["build", "--images", str(images), "--boxes", str(boxes_csv), "--out", str(out),
                                      "--masks", str(masks), "--no-progress"], capsys)
        assert code == 2 and stdout == "" and err.count("\n") == 1 and err.startswith("error: "), (case, err)
        assert named in err and "dog, bird, vehicle, reptile, carnivore, insect, instrument, primate, fish" in err, \
            (case, err)
        assert not out.exists()


# ----------------------------------------------------------------------------------------------------------
# An interrupted build leaves nothing that looks usable

# Runs `python -m tools.data build ARGS...` in a process of its own whose third image waits, once two are written,
# until the signal has reached the main thread: the test interrupts a build that is really half-way.
INTERRUPTIBLE_BUILD = """
import signal, sys, threading
from pathlib import Path
from tools.data import builder, cli

ready, arrived, install = Path(sys.argv[1]), threading.Event(), signal.signal

def observed(signum, handler):  # every handler installed from here on first says that its signal arrived
    def say_and_handle(*args):
        arrived.set()
        return handler(*args)
    return install(signum, say_and_handle if callable(handler) else handler)

signal.signal = observed
signal.signal(signal.SIGINT, signal.default_int_handler)
made, calls = builder.variation_arrays, []

def variation_arrays(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        ready.touch()
        arrived.wait(60)
    return made(*args, **kwargs)

builder.variation_arrays = variation_arrays
sys.exit(cli.main(["build", *sys.argv[2:]]))
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
@pytest.mark.slow
def test_an_interrupted_build_leaves_nothing_that_looks_usable(inputs, tmp_path, signum, code):
    parent = tmp_path / "outputs"
    out = parent / "built"
    finished = signal_when_ready(INTERRUPTIBLE_BUILD, tmp_path / "ready",
                                 ["--images", str(inputs.images), "--boxes", str(inputs.boxes), "--out", str(out),
                                  "--masks", str(inputs.masks), "--workers", "1", "--no-progress"], signum)
    assert finished.returncode == code, finished.stderr
    assert finished.stderr.count("\n") == 1 and "Traceback" not in finished.stderr, finished.stderr
    assert not out.exists() and list(parent.iterdir()) == []  # neither the output nor its temporary folder
    with pytest.raises(UserError, match="does not exist"):
        check.verify_layout(out)


def _dead_pid() -> int:
    """The id of a process that has ended."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                              check=True).stdout)


@pytest.mark.slow
def test_a_build_removes_the_temporary_folders_of_builds_that_died(inputs, tmp_path):
    host = socket.gethostname()
    parent = tmp_path / "outputs"
    stale = parent / f".built{data_build.BUILDING_INFIX}{host}-{_dead_pid()}-0a1b2c3d"  # SIGKILLed half-way
    running = parent / f".built{data_build.BUILDING_INFIX}{host}-{os.getpid()}-0a1b2c3d"
    elsewhere = parent / f".built{data_build.BUILDING_INFIX}other-host-{_dead_pid()}-0a1b2c3d"  # shared disk
    for folder in (stale, running, elsewhere):
        (folder / "original" / "val").mkdir(parents=True)
    (parent / "built").mkdir()  # an empty --out is replaced by the finished build
    builder.build(inputs.images, inputs.boxes, parent / "built", masks=inputs.masks, image_format="png", progress=False)
    assert sorted(p.name for p in parent.iterdir()) == sorted(["built", running.name, elsewhere.name])
    assert check.verify_layout(parent / "built").ok


def test_box_csvs_from_excel_are_read_or_refused_in_one_line(inputs, tmp_path, capsys):
    header, row = "image,xmin,ymin,xmax,ymax", "ça_1.JPEG,60,40,240,220"
    readable = {"utf-8-bom": ("\ufeff" + header + "\n" + row + "\n").encode("utf-8"),
                "utf-16": (header + "\r\n" + row + "\r\n").encode("utf-16")}  # Excel's "Unicode text", with its BOM
    for name, raw in readable.items():
        (tmp_path / f"{name}.csv").write_bytes(raw)
        assert boxes.read_boxes(tmp_path / f"{name}.csv")["ça_1"].boxes == [(60, 40, 240, 220)], name
    (tmp_path / "cp1252.csv").write_bytes((header + "\n" + row + "\n").encode("cp1252"))  # "CSV" in a Western locale
    with pytest.raises(UserError, match=r"cp1252.csv is not UTF-8 text \(byte 0xe7 on line 2\).*save it as CSV UTF-8"):
        boxes.read_boxes(tmp_path / "cp1252.csv")
    (tmp_path / "short.csv").write_text("xmin,ymin,xmax,ymax,image\n60,40,240,220,a.JPEG\n60,40,240\n")
    with pytest.raises(UserError, match="short.csv, line 3: 3 fields where the header names 5"):
        boxes.read_boxes(tmp_path / "short.csv")
    (tmp_path / "nan.csv").write_text(f"{header}\na.JPEG,nan,40,240,220\n")
    with pytest.raises(UserError, match="line 2: the coordinates must be finite numbers"):
        boxes.read_boxes(tmp_path / "nan.csv")
    (tmp_path / "voc").mkdir()
    (tmp_path / "voc" / "a.xml").write_text("<annotation><size><width>inf</width><height>200</height></size>"
                                            "</annotation>")
    with pytest.raises(UserError, match=r"a.xml has no finite number in <width>"):
        boxes.read_boxes(tmp_path / "voc")
    for name in ("cp1252", "short"):  # from the command line: one line, exit 2
        code, _, err = _run_cli(["build", "--images", str(inputs.images), "--boxes", str(tmp_path / f"{name}.csv"),
                                 "--out", str(tmp_path / "out"), "--masks", str(inputs.masks)], capsys)
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: box file"), err
