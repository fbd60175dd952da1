"""--shard I/N and `python -m tools.merge`: the merged shards give what one run gives."""

from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import challenge_eval
import in9_eval
from tests.helpers import page_shows_secret, run_in_process, save_torchscript, secret_image, shows_secret
from tools import cli, merge
from tools.data import synthetic
from tools.results.analysis import FigureLayout

TIMING = ("wall_time_s", "composites_per_s", "composites_evaluated")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    data = synthetic.generate(root / "bg", per_class=3, seed=5).root
    model = root / "color.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9), model)
    return data, model


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A model whose challenge run has another key and other verdicts than the setup's: backgrounds weigh more."""
    path = tmp_path_factory.mktemp("other") / "background.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9, fg_weight=1.0, bg_weight=4.0), path)
    return path


def script(module, capsys, *args):
    argv = [str(a) for a in args] + ["--device", "cpu", "--no-progress", "--log-level", "WARNING"]
    return run_in_process(module.main, argv, capsys)


def results(path: Path) -> dict:
    payload = json.loads(path.read_text())
    return {k: v for k, v in payload.items() if k not in TIMING}


def vulnerable_column(path: Path) -> list[tuple[str, str]]:
    with open(path, newline="") as fh:
        return [(row["stem"], row["vulnerable"]) for row in csv.DictReader(fh)]


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.slow
def test_merged_challenge_shards_equal_one_run(full, setup, tmp_path, capsys):
    data, model = setup
    common = ["--data-path", data, "--checkpoint", model, "--trust-checkpoint", "--no-cache", "--batch-size", 5,
              *(["--full"] if full else [])]
    for index in range(3):
        code, out, err = script(challenge_eval, capsys, *common, "--output-dir", tmp_path / "shards", "--shard",
                                f"{index}/3")
        assert code == 0, err
        assert out.startswith(f"shard {index}/3 written to ")
    extra = ["--analysis"] if full else []
    code, merged_out, err = run_in_process(merge.main, [str(tmp_path / "shards"), "--results-file",
                                                        str(tmp_path / "merged.json"), "--per-foreground-csv",
                                                        str(tmp_path / "merged.csv"), *extra], capsys)
    assert code == 0, err
    code, one_out, err = script(challenge_eval, capsys, *common, "--output-dir", tmp_path / "one", "--results-file",
                                tmp_path / "one.json", "--per-foreground-csv", tmp_path / "one.csv", *extra)
    assert code == 0, err
    assert merged_out == one_out and one_out.startswith("Summary: ")
    merged, one = results(tmp_path / "merged.json"), results(tmp_path / "one.json")
    if full:  # every pair: the same matrix, so the same everything
        assert merged == one
        assert (tmp_path / "merged.csv").read_text() == (tmp_path / "one.csv").read_text()
        assert np.array_equal(np.load(tmp_path / "shards" / "predictions.npy"),
                              np.load(tmp_path / "one" / "predictions.npy"))
        for name in ("asr.csv", "top_backgrounds.csv", "asr_histogram.csv"):
            assert (tmp_path / "shards" / name).read_text() == (tmp_path / "one" / name).read_text()
    else:  # the verdicts and counts; the first fooling background found may differ (the search order)
        assert merged == one
        assert vulnerable_column(tmp_path / "merged.csv") == vulnerable_column(tmp_path / "one.csv")


def test_merged_in9_shards_equal_one_run(setup, tmp_path, capsys):
    data, model = setup
    common = ["--data-path", data, "--checkpoint", model, "--trust-checkpoint", "--eval-dataset", "all",
              "--batch-size", 5]
    for index in range(2):
        code, out, err = script(in9_eval, capsys, *common, "--output-dir", tmp_path / f"s{index}", "--shard",
                                f"{index}/2")
        assert code == 0, err
    code, merged_out, err = run_in_process(merge.main, [str(tmp_path / "s0"), str(tmp_path / "s1"), "--categories",
                                                        "--results-file", str(tmp_path / "merged.json")], capsys)
    assert code == 0, err
    code, one_out, err = script(in9_eval, capsys, *common, "--categories", "--output-dir", tmp_path / "one",
                                "--results-file", tmp_path / "one.json")
    assert code == 0, err
    assert merged_out == one_out and one_out.startswith("Accuracy on original is ")
    assert json.loads((tmp_path / "merged.json").read_text()) == json.loads((tmp_path / "one.json").read_text())


def test_merge_refuses_incomplete_or_foreign_shards(setup, tmp_path, capsys):
    data, model = setup
    common = ["--data-path", data, "--checkpoint", model, "--trust-checkpoint", "--eval-dataset", "only_fg"]
    script(in9_eval, capsys, *common, "--output-dir", tmp_path / "a", "--shard", "0/2")
    code, _, err = run_in_process(merge.main, [str(tmp_path / "a")], capsys)
    assert code == 2 and err.splitlines()[-1].startswith("error: in9 shards of 2: missing shard(s) 1")
    script(in9_eval, capsys, *common[:-1], "original", "--output-dir", tmp_path / "b", "--shard", "1/2")
    code, _, err = run_in_process(merge.main, [str(tmp_path / "a"), str(tmp_path / "b")], capsys)
    assert code == 2 and "come from different runs" in err.splitlines()[-1]
    code, _, err = run_in_process(merge.main, [str(tmp_path / "nowhere")], capsys)
    assert code == 2 and "is not a folder" in err


def test_shard_is_refused_under_torchrun(setup, tmp_path, capsys, monkeypatch):
    data, model = setup
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = script(in9_eval, capsys, "--data-path", data, "--checkpoint", model, "--trust-checkpoint",
                          "--shard", "0/2",
                          "--output-dir", tmp_path)
    assert code == 2 and "drop --shard" in err.splitlines()[-1]


def one_error_line(err: str) -> str:
    """The single `error:` line a refused merge prints (and nothing resembling a traceback)."""
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, err
    return errors[0]


def challenge_shards(data, model, folder, capsys, indices=(0, 1)):
    for index in indices:
        code, _, err = script(challenge_eval, capsys, "--data-path", data, "--checkpoint", model, "--trust-checkpoint",
                              "--no-cache",
                              "--output-dir", folder, "--shard", f"{index}/2")
        assert code == 0, err


@pytest.mark.parametrize("left", ["new arrays, old json", "old arrays, new json"])
@pytest.mark.slow
def test_merge_refuses_a_challenge_shard_rerun_stopped_between_its_two_files(left, setup, other_model, tmp_path,
                                                                           capsys, monkeypatch):
    """Shard 0 rerun with another model: its .npz and .json must not be paired across the two runs."""
    data, model = setup
    folder = tmp_path / "shards"
    challenge_shards(data, model, folder, capsys)
    npz, json_file = folder / "challenge-shard-0-of-2.npz", folder / "challenge-shard-0-of-2.json"
    old_arrays = npz.read_bytes()
    if left == "new arrays, old json":  # the rerun is killed after writing its arrays, before its JSON
        def killed(*_):
            raise KeyboardInterrupt
        with monkeypatch.context() as patch:
            patch.setattr("tools.shards.write_json_atomic", killed)
            code, _, _ = script(challenge_eval, capsys, "--data-path", data, "--checkpoint", other_model,
                                "--trust-checkpoint", "--trust-checkpoint",
                                "--no-cache", "--output-dir", folder, "--shard", "0/2")
        assert code == cli.EXIT_INTERRUPTED and npz.read_bytes() != old_arrays
    else:  # both shards rerun with the other model, but shard 0's arrays are the first run's
        challenge_shards(data, other_model, folder, capsys)
        npz.write_bytes(old_arrays)
    code, out, err = run_in_process(merge.main, [str(folder)], capsys)
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert str(npz) in line and json_file.name in line and "--shard 0/2" in line


def damage(path: Path, how: str) -> None:
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "altered":  # other results under the same key
        with np.load(path) as z:
            arrays = dict(z)
        arrays["verdict"] = 1 - arrays["verdict"]
        np.savez(path, **arrays)
    elif how == "not this format":  # a JSON object without this version's fields, e.g. an older release's
        payload = json.loads(path.read_text())
        path.write_text(json.dumps({k: v for k, v in payload.items() if k not in ("format", "key")}))


@pytest.mark.parametrize("kind, suffix, how", [
    ("challenge", ".npz", "missing"), ("challenge", ".npz", "truncated"), ("challenge", ".npz", "empty"),
    ("challenge", ".npz", "altered"),
    ("challenge", ".json", "truncated"), ("challenge", ".json", "not this format"),
    ("in9", ".json", "truncated"), ("in9", ".json", "empty"), ("in9", ".json", "not this format")])
@pytest.mark.slow
def test_a_damaged_shard_is_refused_with_one_error_line(kind, suffix, how, setup, tmp_path, capsys):
    data, model = setup
    folder = tmp_path / "shards"
    if kind == "challenge":
        challenge_shards(data, model, folder, capsys)
    else:
        for index in range(2):
            code, _, err = script(in9_eval, capsys, "--data-path", data, "--checkpoint", model, "--trust-checkpoint",
                                  "--eval-dataset",
                                  "only_fg", "--output-dir", folder, "--shard", f"{index}/2")
            assert code == 0, err
    damaged = folder / f"{kind}-shard-1-of-2{suffix}"
    damage(damaged, how)
    code, out, err = run_in_process(merge.main, [str(folder)], capsys)
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert str(damaged) in line and "--shard 1/2" in line


@pytest.mark.slow
def test_a_merged_analysis_reads_no_file_outside_the_data_folder_it_is_given(setup, tmp_path, capsys):
    """Shard files name their data folder and the run's files: edited to / and to paths out of it (absolute, climbing,
    through a link), the merged figure and HTML report still read only the --data-path folder's own files."""
    data, model = setup
    copy = tmp_path / "data"
    shutil.copytree(data, copy)
    secret = secret_image(tmp_path / "private")
    folder = tmp_path / "shards"
    for index in range(2):
        code, _, err = script(challenge_eval, capsys, "--data-path", copy, "--checkpoint", model, "--trust-checkpoint",
                              "--no-cache", "--full",
                              "--output-dir", folder, "--shard", f"{index}/2")
        assert code == 0, err
    link = copy / "only_bg_t" / "val" / sorted(os.listdir(copy / "only_bg_t" / "val"))[0] / "zz_link.JPEG"
    link.symlink_to(secret)
    outside = [str(secret), os.path.relpath(secret, copy), link.relative_to(copy).as_posix()]
    for path in folder.glob("challenge-shard-*.json"):
        meta = json.loads(path.read_text())
        meta["data_path"] = "/"
        meta["backgrounds"] = [[outside[j % 3], label] for j, (_, label) in enumerate(meta["backgrounds"])]
        meta["foregrounds"] = [[stem, label, outside[i % 3], mask]
                               for i, (stem, label, _, mask) in enumerate(meta["foregrounds"])]
        path.write_text(json.dumps(meta))
    page = tmp_path / "merged.html"
    code, out, err = run_in_process(merge.main, [str(folder), "--analysis", "--top-k", "2", "--html", str(page),
                                                 "--data-path", str(copy)], capsys)
    assert code == 0, err
    assert out.startswith("Summary: ") and "not shown" in err
    assert not page_shows_secret(page.read_text())
    with Image.open(folder / "top_backgrounds.png") as figure:
        panels = [figure.crop(FigureLayout(rows=9, cols=2).image_box(r, c)) for r in range(9) for c in range(2)]
    assert not any(shows_secret(panel) for panel in panels)
    assert json.loads((folder / "challenge_meta.json").read_text())["data_path"] == str(copy.resolve())


def resign(folder: Path, index: int, change_arrays=None, change_meta=None, count: int = 2) -> None:
    """Edit challenge shard `index`'s arrays and JSON, and record the edited arrays' SHA-256 in the JSON as the merge
    checks it (a re-signed shard: the hash ties the two files together, it vouches for nothing)."""
    from tools.data.hashing import sha256_file  # noqa: PLC0415
    stem = folder / f"challenge-shard-{index}-of-{count}"
    if change_arrays is not None:
        with np.load(stem.with_suffix(".npz")) as z:
            arrays = dict(z)
        change_arrays(arrays)
        np.savez(stem.with_suffix(".npz"), **arrays)
    meta = json.loads(stem.with_suffix(".json").read_text())
    if change_meta is not None:
        change_meta(meta)
    meta["arrays_sha256"] = sha256_file(stem.with_suffix(".npz"))
    stem.with_suffix(".json").write_text(json.dumps(meta))


def claim_shard_0(arrays):  # shard 1 of 2 claims shard 0's foregrounds (and their count)
    arrays["indices"] = np.arange(0, 27, 2)
    for name in ("verdict", "fool_bg", "fool_pred", "min_margin"):
        arrays[name] = np.resize(arrays[name], 14)


def all_robust(arrays):  # --full: every foreground robust, though the matrix says otherwise
    arrays["verdict"][:], arrays["fool_bg"][:], arrays["fool_pred"][:] = 0, -1, -1


SHARD_FORGERIES = {
    "shard 0's foregrounds": (claim_shard_0, None),
    "negative foregrounds": (lambda a: a.update(indices=-1 - a["indices"]), None),
    "a verdict of 5": (lambda a: a["verdict"].__setitem__(0, 5), None),
    "a fooling background past the last": (lambda a: a["fool_bg"].__setitem__(0, 10**6), None),
    "robust rows its matrix fools": (all_robust, None),
    "other background predictions": (lambda a: a.update(bg_pred=(a["bg_pred"] + 1) % 9), None),
    "a matrix of 9 x 9": (lambda a: a.update(matrix=np.zeros((9, 9), np.int8)), None),
    "the name of shard 0": (None, lambda m: m.update(shard=[0, 2])),
    "other foregrounds' classes": (None,
                                   lambda m: m["foregrounds"][0].__setitem__(1, (m["foregrounds"][0][1] + 1) % 9)),
    "a class of 12": (None, lambda m: m["backgrounds"][0].__setitem__(1, 12)),
    "a criterion of its own": (None, lambda m: m["results"].update(criterion="some")),
    "no provenance": (None, lambda m: m["results"].update(provenance=None)),
    # tracebacks before: a rate of more pairs than a float holds (OverflowError), a time JSON cannot write
    "more pairs than a float holds": (None, lambda m: m["results"].update(composites_evaluated=10**400)),
    "an endless time": (None, lambda m: m["results"].update(wall_time_s=float("inf"))),
}


@pytest.fixture(scope="module")
def full_shards(setup, tmp_path_factory):
    """The two --full shards of the setup's challenge (27 foregrounds)."""
    from tests.helpers import run_command  # noqa: PLC0415
    data, model = setup
    folder = tmp_path_factory.mktemp("full_shards")
    for index in range(2):
        run_command(challenge_eval.main, ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint",
                                          "--no-cache", "--full",
                                          "--output-dir", str(folder), "--shard", f"{index}/2", "--device", "cpu",
                                          "--no-progress", "--log-level", "WARNING"])
    return folder


@pytest.mark.parametrize("name", SHARD_FORGERIES)
@pytest.mark.slow
def test_a_resigned_challenge_shard_that_does_not_fit_its_run_is_refused(name, full_shards, tmp_path, capsys):
    folder = tmp_path / "shards"
    shutil.copytree(full_shards, folder)
    resign(folder, 1, *SHARD_FORGERIES[name])
    code, out, err = run_in_process(merge.main, [str(folder), "--results-file", str(tmp_path / "merged.json")], capsys)
    assert code == 2 and out == "", name
    line = one_error_line(err)
    assert "rerun" in line and not (tmp_path / "merged.json").exists(), name


def test_the_resigned_shards_unedited_merge(full_shards, tmp_path, capsys):
    """Re-signing alone changes nothing: the checks refuse what the edits make, not the files."""
    folder = tmp_path / "shards"
    shutil.copytree(full_shards, folder)
    resign(folder, 1)
    code, out, err = run_in_process(merge.main, [str(folder)], capsys)
    assert code == 0 and out.startswith("Summary: "), err


@pytest.mark.parametrize("name", ["swapped shares", "a prediction of 11", "a prediction beyond 64 bits",
                                  "another shard's image list"])
@pytest.mark.slow
def test_an_in9_shard_predicting_what_it_does_not_own_is_refused(name, setup, tmp_path, capsys):
    data, model = setup
    folder = tmp_path / "shards"
    for index in range(2):
        code, _, err = script(in9_eval, capsys, "--data-path", data, "--checkpoint", model, "--trust-checkpoint",
                              "--eval-dataset",
                              "only_fg", "--batch-size", 4, "--output-dir", folder, "--shard", f"{index}/2")
        assert code == 0, err
    paths = [folder / f"in9-shard-{index}-of-2.json" for index in range(2)]
    metas = [json.loads(path.read_text()) for path in paths]
    if name == "swapped shares":  # each predicts the other's images: every image still predicted once
        metas[0]["variations"], metas[1]["variations"] = metas[1]["variations"], metas[0]["variations"]
    elif name in ("a prediction of 11", "a prediction beyond 64 bits"):  # the latter: an OverflowError before
        predictions = metas[0]["variations"]["only_fg"]["predictions"]
        predictions[next(i for i, p in enumerate(predictions) if p != merge.NOT_MINE)] = 11 if "11" in name else 2**64
    else:
        metas[1]["variations"]["only_fg"]["labels"][0] = (metas[1]["variations"]["only_fg"]["labels"][0] + 1) % 9
    for path, meta in zip(paths, metas):
        path.write_text(json.dumps(meta))
    code, out, err = run_in_process(merge.main, [str(folder)], capsys)
    assert code == 2 and out == "", name
    assert "rerun" in one_error_line(err), name


@pytest.mark.slow
def test_shards_listing_300000_foregrounds_and_backgrounds_merge_without_their_product(setup, tmp_path, capsys):
    """A merge makes nothing of foregrounds x backgrounds but a --full matrix the shards hold: listings forged to
    300,000 of each (with arrays to match, re-signed) once made it allocate 83.8 GiB."""
    data, model = setup
    folder = tmp_path / "shards"
    challenge_shards(data, model, folder, capsys)
    size = 300_000

    def listings(meta):
        meta["foregrounds"] = [meta["foregrounds"][i % 27] for i in range(size)]
        meta["backgrounds"] = [meta["backgrounds"][j % 27] for j in range(size)]

    for index in range(2):
        def arrays(a, index=index):
            n = len(np.arange(index, size, 2))
            a.update(indices=np.arange(index, size, 2), verdict=np.zeros(n, np.int8), fool_bg=np.full(n, -1),
                     fool_pred=np.full(n, -1), min_margin=np.full(n, np.inf, np.float32),
                     bg_pred=np.resize(a["bg_pred"], size))
        resign(folder, index, arrays, listings)
    code, out, err = run_in_process(merge.main, [str(folder)], capsys)
    assert code == 0 and "Traceback" not in err, err
    assert out.startswith(f"Summary: 0/{size} ")


def test_a_shard_count_beyond_what_a_run_is_split_into_is_one_line(setup, tmp_path, capsys):
    """--shard 0/N of a count numpy cannot hold was an OverflowError traceback in the run."""
    data, model = setup
    with pytest.raises(SystemExit) as exited:  # refused as the command line is read
        script(in9_eval, capsys, "--data-path", data, "--checkpoint", model, "--trust-checkpoint", "--eval-dataset",
               "only_fg", "--output-dir", tmp_path / "out", "--shard", f"0/{10**20}")
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert "--shard" in one_error_line(err)


@pytest.mark.parametrize("count", [10**20, 2**31 - 1])
@pytest.mark.slow
def test_a_shard_claiming_a_huge_split_is_refused_without_making_it(count, setup, tmp_path, capsys):
    """A shard file named (and saying) shard 0 of a huge N: beyond what numpy holds it was an OverflowError
    traceback; within it, the merge listed every shard of N to name the missing ones (2**31 of them: memory ran
    out). Run in a process of bounded memory."""
    data, model = setup
    folder = tmp_path / "shards"
    code, _, err = script(in9_eval, capsys, "--data-path", data, "--checkpoint", model, "--trust-checkpoint",
                          "--eval-dataset", "only_fg", "--batch-size", 4, "--output-dir", folder, "--shard", "0/1")
    assert code == 0, err
    meta = json.loads((folder / "in9-shard-0-of-1.json").read_text())
    meta["shard"] = [0, count]
    predictions = meta["variations"]["only_fg"]["predictions"]
    predictions[4:] = [merge.NOT_MINE] * len(predictions[4:])  # shard 0 of N owns the first batch alone
    (folder / "in9-shard-0-of-1.json").unlink()
    (folder / f"in9-shard-0-of-{count}.json").write_text(json.dumps(meta))
    proc = subprocess.run([sys.executable, "-c",
                           "import sys; from tools import merge; sys.exit(merge.main(sys.argv[1:]))", str(folder)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    one_error_line(proc.stderr)
