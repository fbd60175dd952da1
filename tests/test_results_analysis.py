"""The background analysis and the prediction categories against brute-force references and hand-built models.

The prediction matrix is computed here by brute force (every foreground on every background, composited
with numpy, through a small model) and saved in the format challenge_eval.py --full writes, so these
tests check tools.results.analysis against the format's definition, not against the engine.
"""

from __future__ import annotations

import csv
import json
import logging
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tools.data import layout, synthetic
from tools.errors import UserError
from tools.in9 import IN9_MEAN, IN9_STD, NUM_IN9_CLASSES, class_names
from tools.in9.evaluate import VariationResult
from tools.results import analysis, categories
from tools.results.categories import Category

NAMES = class_names()


# ----------------------------------------------------------------------------------------------------------
# Hand-built models: uint8 (N, H, W, 3) images in, IN-9 predictions out

class ColourModel:
    """tools.data.synthetic's colour-evidence classifier, normalised as the toolkit's wrapper would."""

    def __init__(self, **kwargs):
        self.net = synthetic.ColorEvidenceModel(NUM_IN9_CLASSES, **kwargs).eval()
        self.mean = torch.tensor(IN9_MEAN).view(1, 3, 1, 1)
        self.std = torch.tensor(IN9_STD).view(1, 3, 1, 1)

    def __call__(self, images: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255
        with torch.inference_mode():
            return self.net((x - self.mean) / self.std).argmax(dim=1).numpy()


class ForegroundColourModel:
    """Looks only for the generator's nine foreground colours: each pixel of a 4-pixel grid goes to the nearest
    of the eighteen palette colours, and the answer is the foreground colour with the most pixels. Backgrounds
    are built from the background colours, so every composite is predicted as its foreground's class."""

    def __call__(self, images: np.ndarray) -> np.ndarray:
        palette = np.concatenate([synthetic.FG_COLORS, synthetic.BG_COLORS])  # (18, 3), in [0, 1]
        samples = images[:, ::4, ::4].astype(np.float32) / 255
        nearest = ((samples[..., None, :] - palette) ** 2).sum(axis=-1).argmin(axis=-1)  # (N, 56, 56)
        counts = np.stack([(nearest == k).sum(axis=(1, 2)) for k in range(NUM_IN9_CLASSES)], axis=1)
        return counts.argmax(axis=1)


class CornerModel:
    """Looks only at the top-left 16x16 patch, which the generator always leaves background, and answers the
    class of the background whose patch is nearest: every composite is predicted as its background's class."""

    def __init__(self, backgrounds: np.ndarray, labels: np.ndarray):
        self.patches = backgrounds[:, :16, :16].astype(np.int64)
        self.labels = labels

    def __call__(self, images: np.ndarray) -> np.ndarray:
        patches = images[:, None, :16, :16].astype(np.int64)
        distance = ((patches - self.patches[None]) ** 2).sum(axis=(2, 3, 4))
        return self.labels[distance.argmin(axis=1)]


def read_rgb(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def first_per_class(records: list, n: int) -> list:
    """The first n records of each class, in order."""
    seen: dict[int, int] = {}
    kept = []
    for record in records:
        seen[record.label] = seen.get(record.label, 0) + 1
        if seen[record.label] <= n:
            kept.append(record)
    return kept


FG_PER_CLASS, BG_PER_CLASS = 2, 3  # 18 x 27 composites: a non-square matrix, quick on a CPU


@pytest.fixture(scope="module")
def challenge_data(dataset):
    """The generated challenge: foreground records, background records, and the three models' matrices."""
    root = dataset.root
    fgs = first_per_class(layout.list_foregrounds(root), FG_PER_CLASS)
    bgs = first_per_class(layout.list_variation(root, "only_bg_t"), BG_PER_CLASS)
    fg_images = [read_rgb(root / r.image_relpath) for r in fgs]
    masks = [np.load(root / r.mask_relpath) for r in fgs]
    bg_images = np.stack([read_rgb(root / r.relpath) for r in bgs])
    bg_labels = np.array([r.label for r in bgs])
    models = {"colour": ColourModel(), "corner": CornerModel(bg_images, bg_labels),
              "foreground": ForegroundColourModel()}
    matrices = {name: np.zeros((len(fgs), len(bgs)), dtype=np.int8) for name in models}
    for i in range(len(fgs)):
        composites = []
        for j in range(len(bgs)):
            composites.append(np.where(masks[i][..., None], fg_images[i], bg_images[j]))
        composites = np.stack(composites)
        for name, model in models.items():
            matrices[name][i] = model(composites)
    return fgs, bgs, matrices


def save_challenge(out: Path, predictions: np.ndarray, fgs, bgs, data_path: Path | None,
                   criterion: str = "any") -> Path:
    """Write predictions.npy, foregrounds.csv, backgrounds.csv and challenge_meta.json as the engine does."""
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "predictions.npy", predictions.astype(np.int8))
    with open(out / "foregrounds.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["index", "stem", "label", "image", "mask"])
        for i, r in enumerate(fgs):
            writer.writerow([i, r.stem, r.label, r.image_relpath, r.mask_relpath])
    with open(out / "backgrounds.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["index", "stem", "label", "image"])
        for j, r in enumerate(bgs):
            writer.writerow([j, r.stem, r.label, r.relpath])
    meta = {"data_path": None if data_path is None else str(data_path), "criterion": criterion, "num_classes": 9,
            "provenance": {"toolkit_version": "test", "device": "cpu", "precision": "fp32"}}
    (out / "challenge_meta.json").write_text(json.dumps(meta))
    return out


# ----------------------------------------------------------------------------------------------------------
# Brute-force references, written for clarity

def ref_asr(P, fg_labels, bg_labels, j) -> Fraction:
    eligible = [i for i in range(len(fg_labels)) if fg_labels[i] != bg_labels[j]]
    fooled = [i for i in eligible if P[i][j] == bg_labels[j]]
    return Fraction(len(fooled), len(eligible))


def ref_fool_rate(P, fg_labels, bg_labels, c) -> Fraction | None:
    class_backgrounds = [j for j in range(len(bg_labels)) if bg_labels[j] == c]
    if not class_backgrounds:
        return None
    others = [i for i in range(len(fg_labels)) if fg_labels[i] != c]
    fooled = 0
    for i in others:
        for j in class_backgrounds:
            if P[i][j] == c:
                fooled += 1
                break
    return Fraction(fooled, len(others))


def ref_top(P, fg_labels, bg_labels, c, k) -> list[int]:
    left = [j for j in range(len(bg_labels)) if bg_labels[j] == c]
    chosen = []
    while left and len(chosen) < k:
        best = left[0]
        for j in left:  # increasing index: only a strictly higher ASR displaces, so ties keep the lower index
            if ref_asr(P, fg_labels, bg_labels, j) > ref_asr(P, fg_labels, bg_labels, best):
                best = j
        chosen.append(best)
        left.remove(best)
    return chosen


def ref_histogram(P, fg_labels, bg_labels, c, bins=20) -> list[int]:
    counts = [0] * bins
    for j in range(len(bg_labels)):
        if bg_labels[j] != c:
            continue
        rate = ref_asr(P, fg_labels, bg_labels, j)
        for b in range(bins):
            if Fraction(b, bins) <= rate < Fraction(b + 1, bins) or (b == bins - 1 and rate == 1):
                counts[b] += 1
    return counts


def ref_fooled_into_bg_class(P, fg_labels, bg_labels) -> int:
    count = 0
    for i in range(len(fg_labels)):
        if any(P[i][j] == bg_labels[j] != fg_labels[i] for j in range(len(bg_labels))):
            count += 1
    return count


def check_against_references(out: Path, summary: dict, P, fg_labels, bg_labels, k: int) -> None:
    P, fg_labels, bg_labels = P.tolist(), list(fg_labels), list(bg_labels)
    with open(out / "asr.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(bg_labels)
    for j, row in enumerate(rows):
        expected = ref_asr(P, fg_labels, bg_labels, j)
        assert int(row["index"]) == j and row["class"] == NAMES[bg_labels[j]]
        assert Fraction(int(row["fooled"]), int(row["eligible"])) == expected
        assert float(row["asr"]) == pytest.approx(float(expected), abs=1e-6)
    with open(out / "top_backgrounds.csv", newline="") as fh:
        top_rows = list(csv.DictReader(fh))
    with open(out / "asr_histogram.csv", newline="") as fh:
        histogram_rows = {row["class"]: row for row in csv.DictReader(fh)}
    for c, name in enumerate(NAMES):
        info = summary["per_class"][name]
        rate = ref_fool_rate(P, fg_labels, bg_labels, c)
        assert (info["fool_rate"] is None) == (rate is None)
        if rate is not None:
            assert Fraction(info["fooled_foregrounds"], info["other_foregrounds"]) == rate
            assert info["fool_rate"] == pytest.approx(float(rate), abs=1e-6)
        top = ref_top(P, fg_labels, bg_labels, c, k)
        assert [e["index"] for e in info["top_backgrounds"]] == top
        assert [int(r["index"]) for r in top_rows if r["class"] == name] == top
        for e in info["top_backgrounds"]:
            assert e["asr"] == pytest.approx(float(ref_asr(P, fg_labels, bg_labels, e["index"])), abs=1e-6)
        histogram = ref_histogram(P, fg_labels, bg_labels, c)
        assert info["asr_histogram"] == histogram
        assert [int(v) for key, v in histogram_rows[name].items() if key != "class"] == histogram
    assert summary["fooled_into_bg_class"] == ref_fooled_into_bg_class(P, fg_labels, bg_labels)
    assert json.loads((out / "analysis.json").read_text()) == summary


# ----------------------------------------------------------------------------------------------------------
# The quantities

@pytest.mark.slow
def test_generated_challenge_matches_brute_force(challenge_data, dataset, tmp_path):
    fgs, bgs, matrices = challenge_data
    P = matrices["colour"]
    fg_labels, bg_labels = [r.label for r in fgs], [r.label for r in bgs]
    assert 0 < (P != np.array(fg_labels)[:, None]).sum() < P.size  # some composites fool the model, not all
    out = save_challenge(tmp_path / "run", P, fgs, bgs, dataset.root)
    summary = analysis.write_analysis(out, top_k=3)
    check_against_references(out, summary, P, fg_labels, bg_labels, k=3)
    assert (summary["foregrounds"], summary["backgrounds"]) == (18, 27)
    assert summary["criterion"] == "any" and summary["provenance"]["device"] == "cpu"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_matrix_with_ties_and_unmapped_matches_brute_force(seed, tmp_path, caplog):
    rng = np.random.default_rng(seed)
    fg_labels = rng.integers(0, NUM_IN9_CLASSES, size=30)
    bg_labels = rng.integers(0, NUM_IN9_CLASSES - 1, size=25)  # no background of class 8 (fish)
    P = rng.integers(-1, NUM_IN9_CLASSES, size=(30, 25))
    fgs = [layout.ForegroundRecord(f"fg{i}", int(c), f"original/val/x/fg{i}.JPEG", f"fg_mask/val/x/fg{i}.npy")
           for i, c in enumerate(fg_labels)]
    bgs = [layout.ImageRecord(f"only_bg_t/val/x/bg{j}.JPEG", int(c)) for j, c in enumerate(bg_labels)]
    out = save_challenge(tmp_path / "run", P, fgs, bgs, data_path=None)
    with caplog.at_level(logging.WARNING, logger="tools.results.analysis"):
        summary = analysis.write_analysis(out, top_k=4)
    check_against_references(out, summary, P, fg_labels, bg_labels, k=4)
    fish = summary["per_class"]["fish"]
    assert fish["fool_rate"] is None and fish["top_backgrounds"] == [] and fish["backgrounds"] == 0
    assert "no data folder is known" in caplog.text  # the figure drew placeholders and said so


def test_background_only_model_makes_every_background_fool(challenge_data, dataset, tmp_path):
    fgs, bgs, matrices = challenge_data
    P = matrices["corner"]
    bg_labels = np.array([r.label for r in bgs])
    assert (P == bg_labels[None, :]).all()  # the premise: every composite is its background's class
    summary = analysis.write_analysis(save_challenge(tmp_path / "run", P, fgs, bgs, dataset.root), top_k=3)
    for c, name in enumerate(NAMES):
        info = summary["per_class"][name]
        assert info["fool_rate"] == 1.0 and info["fooled_foregrounds"] == info["other_foregrounds"] == 16
        assert info["mean_asr"] == info["max_asr"] == 1.0
        assert [e["asr"] for e in info["top_backgrounds"]] == [1.0, 1.0, 1.0]
        assert [e["index"] for e in info["top_backgrounds"]] == [3 * c, 3 * c + 1, 3 * c + 2]  # ties: lowest index
        assert info["asr_histogram"] == [0] * 19 + [3]
    assert summary["fooled_into_bg_class"] == 18


def test_foreground_only_model_is_never_fooled(challenge_data, dataset, tmp_path):
    fgs, bgs, matrices = challenge_data
    P = matrices["foreground"]
    fg_labels = np.array([r.label for r in fgs])
    assert (P == fg_labels[:, None]).all()  # the premise: every composite is its foreground's class
    summary = analysis.write_analysis(save_challenge(tmp_path / "run", P, fgs, bgs, dataset.root))
    for name in NAMES:
        info = summary["per_class"][name]
        assert info["fool_rate"] == 0.0 and info["max_asr"] == 0.0
        assert info["asr_histogram"] == [3] + [0] * 19
        assert len(info["top_backgrounds"]) == 3  # top-5 of a class with three backgrounds
    assert summary["fooled_into_bg_class"] == 0


def test_top_k_orders_by_asr_then_index():
    fooled = np.array([3, 5, 5, 1, 0, 5, 2])
    labels = np.array([0, 0, 0, 0, 1, 0, 1])
    top = analysis.top_backgrounds(fooled, labels, k=4)
    assert top[0].tolist() == [1, 2, 5, 0] and top[1].tolist() == [6, 4] and top[2].tolist() == []


def test_histogram_bin_edges_are_exact():
    eligible = np.full(6, 20)
    fooled = np.array([0, 1, 3, 19, 20, 10])  # ASR 0, 0.05, 0.15, 0.95, 1.0, 0.5
    assert analysis.asr_bins(fooled, eligible).tolist() == [0, 1, 3, 19, 19, 10]


# ----------------------------------------------------------------------------------------------------------
# The figure

def test_figure_has_one_row_per_class_and_every_panel_drawn(challenge_data, dataset, tmp_path):
    fgs, bgs, matrices = challenge_data
    out = save_challenge(tmp_path / "run", matrices["colour"], fgs, bgs, data_path=None)
    summary = analysis.write_analysis(out, data_path=dataset.root, top_k=3)
    layout = analysis.FigureLayout(rows=9, cols=3)
    with Image.open(out / "top_backgrounds.png") as img:
        figure = np.asarray(img.convert("RGB"))
    thumb, gap, caption, label, title, margin = 112, 10, 20, 130, 52, 12
    assert (layout.thumb, layout.gap, layout.caption, layout.label, layout.title, layout.margin) == \
        (thumb, gap, caption, label, title, margin)
    width = max(2 * margin + label + 3 * thumb + 2 * gap, 580)
    assert figure.shape == (title + 9 * (caption + thumb) + 8 * gap + margin, width, 3)
    for row, name in enumerate(NAMES):
        for col, entry in enumerate(summary["per_class"][name]["top_backgrounds"]):
            x0, y0, x1, y1 = layout.image_box(row, col)
            panel = figure[y0:y1, x0:x1].reshape(-1, 3).astype(float)
            source = read_rgb(dataset.root / entry["image"]).reshape(-1, 3).astype(float)
            assert np.abs(panel.mean(axis=0) - source.mean(axis=0)).max() < 8  # the right image, in its place
            cx0, cy0, cx1, _ = layout.panel_box(row, col)
            assert (figure[cy0:cy0 + caption, cx0:cx1] < 128).any()  # the ASR caption is drawn
        _, y0, _, y1 = layout.image_box(row, 0)
        assert (figure[y0:y1, margin:margin + label] < 128).any()  # the class name is drawn


def test_figure_draws_placeholders_for_missing_images(challenge_data, tmp_path, caplog):
    fgs, bgs, matrices = challenge_data
    out = save_challenge(tmp_path / "run", matrices["colour"], fgs, bgs, data_path=tmp_path / "gone")
    with caplog.at_level(logging.WARNING, logger="tools.results.analysis"):
        analysis.write_analysis(out, data_path=tmp_path / "gone", top_k=2)
    assert "18 of 18 background image(s)" in caplog.text and str(tmp_path / "gone") in caplog.text
    layout = analysis.FigureLayout(rows=9, cols=2)
    with Image.open(out / "top_backgrounds.png") as img:
        figure = np.asarray(img.convert("RGB"))
    for row in range(9):
        for col in range(2):
            x0, y0, x1, y1 = layout.image_box(row, col)
            grey = (figure[y0:y1, x0:x1] == analysis.PLACEHOLDER).all(axis=2)
            assert grey.mean() > 0.8


# ----------------------------------------------------------------------------------------------------------
# Reading and the command line

def test_command_line_writes_everything(challenge_data, dataset, tmp_path, capsys):
    fgs, bgs, matrices = challenge_data
    out = save_challenge(tmp_path / "run", matrices["colour"], fgs, bgs, dataset.root)
    assert analysis.main([str(out), "--top-k", "2"]) == 0
    printed = capsys.readouterr().out
    assert "fool rate" in printed and "dog" in printed
    for name in ("asr.csv", "top_backgrounds.csv", "asr_histogram.csv", "analysis.json", "top_backgrounds.png"):
        assert (out / name).is_file()
    assert json.loads((out / "analysis.json").read_text())["top_k"] == 2


def test_missing_matrix_is_one_line_error(tmp_path, capsys):
    assert analysis.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert "predictions.npy" in err and "challenge_eval.py --full" in err
    assert analysis.main([str(tmp_path / "absent")]) == 2
    assert f"{tmp_path / 'absent'} is not a folder" in capsys.readouterr().err


def test_bad_top_k_fails_at_parse_time(tmp_path):
    with pytest.raises(SystemExit) as exc:
        analysis.main([str(tmp_path), "--top-k", "0"])
    assert exc.value.code == 2


def _tiny_run(tmp_path: Path) -> tuple[Path, list, list]:
    fgs = [layout.ForegroundRecord(f"f{i}", i % 2, f"original/val/x/f{i}.JPEG", f"fg_mask/val/x/f{i}.npy")
           for i in range(4)]
    bgs = [layout.ImageRecord(f"only_bg_t/val/x/b{j}.JPEG", j % 3) for j in range(3)]
    return save_challenge(tmp_path / "run", np.zeros((4, 3), dtype=np.int8), fgs, bgs, None), fgs, bgs


def test_inconsistent_files_are_user_errors(tmp_path):
    out, fgs, bgs = _tiny_run(tmp_path)
    np.save(out / "predictions.npy", np.zeros((4, 2), dtype=np.int8))
    with pytest.raises(UserError, match=r"shape \(4, 2\) but foregrounds.csv lists 4 foregrounds"):
        analysis.load_matrix(out)
    np.save(out / "predictions.npy", np.full((4, 3), 9, dtype=np.int8))
    with pytest.raises(UserError, match="values from 9 to 9"):
        analysis.load_matrix(out)
    np.save(out / "predictions.npy", np.zeros((4, 3), dtype=np.int8))
    (out / "backgrounds.csv").write_text("index,stem,image\n0,b0,x.JPEG\n")
    with pytest.raises(UserError, match="expected index,stem,label,image"):
        analysis.load_matrix(out)
    (out / "backgrounds.csv").write_text("index,stem,label,image\n0,b0,0,x\n2,b1,0,y\n1,b2,0,z\n")
    with pytest.raises(UserError, match="row 3 has index 2, expected 1"):
        analysis.load_matrix(out)
    (out / "challenge_meta.json").unlink()
    with pytest.raises(UserError, match="lacks challenge_meta.json"):
        analysis.load_matrix(out)


def test_one_foreground_class_is_refused(tmp_path):
    out, fgs, bgs = _tiny_run(tmp_path)
    (out / "foregrounds.csv").write_text("index,stem,label,image,mask\n" +
                                         "".join(f"{i},f{i},0,a,b\n" for i in range(4)))
    with pytest.raises(UserError, match="fewer than two classes"):
        analysis.load_matrix(out)


# ----------------------------------------------------------------------------------------------------------
# Prediction categories

def _result(name: str, rows: list[tuple[str, int, int]]) -> VariationResult:
    """rows: (stem, label, prediction)."""
    return VariationResult(name, [f"{name}/val/{label:02d}_{NAMES[label]}/{stem}.JPEG" for stem, label, _ in rows],
                           np.array([label for _, label, _ in rows]), np.array([p for _, _, p in rows]))


# (stem, label, full prediction, foreground prediction, background prediction, expected category)
CASES = [
    ("a1", 0, 0, 0, 0, Category.BG_IRRELEVANT),  # both right
    ("a2", 0, 0, 0, 5, Category.BG_IRRELEVANT),  # both right, background wrong
    ("a3", 1, 2, 3, 2, Category.BG_IRRELEVANT),  # both wrong
    ("a4", 1, -1, -1, 1, Category.BG_IRRELEVANT),  # both wrong (unmapped)
    ("b1", 1, 1, 4, 1, Category.BG_REQUIRED),
    ("b2", 2, 2, -1, 2, Category.BG_REQUIRED),
    ("c1", 2, 2, 3, 4, Category.BG_FG_REQUIRED),
    ("c2", 0, 0, 5, -1, Category.BG_FG_REQUIRED),
    ("c3", 0, 0, 5, 5, Category.BG_FG_REQUIRED),
    ("d1", 3, 6, 3, 6, Category.BG_FOOLS),
    ("d2", 0, 4, 0, 4, Category.BG_FOOLS),
    ("e1", 3, 6, 3, 7, Category.OTHER),  # background wrong, but not the full image's prediction
    ("e2", 3, 6, 3, 3, Category.OTHER),  # background right
    ("e3", 0, -1, 0, -1, Category.OTHER),  # -1 twice is not "the same prediction"
]


def _case_results(cases=CASES, shuffle_seed: int = 0):
    order = np.random.default_rng(shuffle_seed).permutation(len(cases))
    full = _result("original", [(s, lab, f) for s, lab, f, _, _, _ in cases])
    fg = _result("mixed_rand", [(cases[k][0], cases[k][1], cases[k][3]) for k in order])  # another order
    bg = _result("only_bg_t", [(s, lab, b) for s, lab, _, _, b, _ in cases][::-1])
    return full, fg, bg


def test_categories_have_the_known_counts():
    result = categories.prediction_categories(*_case_results())
    expected = {cat.value: sum(1 for case in CASES if case[5] is cat) for cat in Category}
    assert expected == {"bg_irrelevant": 4, "bg_required": 2, "bg_fg_required": 3, "bg_fools": 2, "other": 3}
    assert result["overall"]["counts"] == expected and result["overall"]["images"] == 14
    assert result["overall"]["percent"]["bg_fg_required"] == pytest.approx(100 * 3 / 14, abs=1e-4)
    for c, name in enumerate(NAMES):
        per_class = {cat.value: sum(1 for case in CASES if case[1] == c and case[5] is cat) for cat in Category}
        assert result["per_class"][name]["counts"] == per_class
    assert result["per_class"]["dog"]["images"] == 6 and result["per_class"]["fish"]["percent"]["other"] is None
    assert result["variations"] == {"full": "original", "foreground": "mixed_rand", "background": "only_bg_t"}
    json.dumps(result)  # JSON-able


def test_categories_table_text():
    text = categories.format_categories(categories.prediction_categories(*_case_results()))
    lines = text.splitlines()
    assert all(title in lines[0] for title in ("BG Irrelevant", "BG Required", "BG+FG Required", "BG Fools", "Other"))
    assert lines[1].split()[:3] == ["all", "14", "28.6%"] and len(lines) == 1 + 1 + 9 + 1


def test_categories_refuse_mismatched_stems():
    full, fg, bg = _case_results()
    short = _result("mixed_rand", [("zz9", 0, 0)] + [(s, lab, p) for s, lab, p, _, _, _ in CASES[2:]])
    with pytest.raises(UserError, match=r"2 stem\(s\) of original missing from mixed_rand \(a1, a2\); "
                                        r"1 stem\(s\) of mixed_rand not in original \(zz9\)"):
        categories.prediction_categories(full, short, bg)
    twice = _result("only_bg_t", [(s, lab, b) for s, lab, _, _, b, _ in CASES] + [("a1", 0, 0)])
    with pytest.raises(UserError, match="two images with the stem 'a1'"):
        categories.prediction_categories(full, fg, twice)
    relabelled = _result("only_bg_t", [(s, (lab + 1) % 9 if s == "b1" else lab, b) for s, lab, _, _, b, _ in CASES])
    with pytest.raises(UserError, match=r"1 image\(s\) have another class in only_bg_t than in original \(b1\)"):
        categories.prediction_categories(full, fg, relabelled)
