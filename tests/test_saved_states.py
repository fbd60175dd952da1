"""Saved states are believed only as far as they fit the run reading them back: a resume state with the run's key
but forged or malformed content (the challenge's, in9's, train.py's) is one `error:` line, never a traceback, a huge
allocation or a forged number. Each state is made by a real run and then edited by the test, its key kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import challenge_eval
import in9_eval
from tests.helpers import TINY, check_error, run_command, run_in_process, run_train, save_torchscript
from tools.challenge.state import ROBUST, STATE_NAME, UNKNOWN, VULNERABLE
from tools.data import synthetic
from tools.training.checkpoint import STATE_NAME as TRAINING_STATE

QUIET = ["--device", "cpu", "--no-progress", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("states")
    data = synthetic.generate(root / "bg", per_class=2, seed=7).root
    model = root / "color.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9), model)
    return data, model


def challenge_args(setup, out: Path, *extra) -> list[str]:
    data, model = setup
    return ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint",
            "--no-cache", "--output-dir", str(out), *QUIET,
            *map(str, extra)]


@pytest.fixture(scope="module")
def finished(setup, tmp_path_factory):
    """The final state of a search and of a --full run (18 foregrounds x 18 backgrounds), by --full."""
    folders = {}
    for full in (False, True):
        folders[full] = tmp_path_factory.mktemp("full" if full else "search")
        run_command(challenge_eval.main, challenge_args(setup, folders[full], *(["--full"] if full else [])))
    return folders


def edit(path: Path, change) -> None:
    """Rewrite the .npz at `path` with `change(arrays)` applied; its key stays the run's."""
    with np.load(path) as z:
        arrays = dict(z)
    change(arrays)
    np.savez(path, **arrays)


def robust_untested(a):  # every foreground robust, nothing tested: "Challenge accuracy: 100.00%"
    a["verdict"][:] = ROBUST
    a["fool_bg"][:], a["fool_pred"][:] = -1, -1
    a["tested"][:] = 0


def fooled_into_own_class(a):  # every foreground vulnerable, to a prediction of its own class (dog: class 0)
    a["verdict"][:], a["fool_bg"][:], a["fool_pred"][:] = VULNERABLE, 0, 0


def first_vulnerable(a) -> int:
    return int(np.flatnonzero(a["verdict"] == VULNERABLE)[0])


SEARCH_FORGERIES = {
    "robust, never tested": robust_untested,
    "fooled into its own class": fooled_into_own_class,
    "a shape of 10^11 backgrounds": lambda a: a.update(shape=np.array([a["shape"][0], 10**11])),
    "one verdict too many": lambda a: a.update(verdict=np.append(a["verdict"], np.int8(0))),
    "verdicts as floats": lambda a: a.update(verdict=a["verdict"].astype(np.float32)),
    "a verdict of 7": lambda a: a["verdict"].__setitem__(0, 7),
    "a fooling background past the last": lambda a: a["fool_bg"].__setitem__(first_vulnerable(a), 10**6),
    "a negative fooling background": lambda a: a["fool_bg"].__setitem__(first_vulnerable(a), -3),
    "a worklist past the foregrounds": lambda a: a.update(worklist=np.array([[10**6, 0]], np.int32),
                                                          scalars=np.array([0, *a["scalars"][1:]])),
    "pending pairs before the backgrounds": lambda a: a.update(pending=np.array([[0, -4]], np.int64),
                                                               pending_sizes=np.array([1])),
    "two scalars": lambda a: a.update(scalars=a["scalars"][:2]),
    "an elapsed time of NaN": lambda a: a.update(elapsed=np.array(np.nan)),
    "more successes than trials": lambda a: a["successes"].__setitem__((0, 0), a["trials"][0, 0] + 1),
    "a --full matrix in a search": lambda a: a.update(matrix=np.zeros((len(a["verdict"]), a["shape"][1]), np.int8)),
}
FULL_FORGERIES = {
    "predictions of 50": lambda a: a["matrix"].__setitem__((0, 0), 50),
    "no matrix": lambda a: a.pop("matrix"),
    "robust rows its matrix fools": robust_untested,
    "predictions of pairs never tested": lambda a: a.update(tested=np.zeros_like(a["tested"]),
                                                            verdict=np.full_like(a["verdict"], UNKNOWN)),
}


@pytest.mark.parametrize("full, name, change", [(False, n, c) for n, c in SEARCH_FORGERIES.items()]
                         + [(True, n, c) for n, c in FULL_FORGERIES.items()])
@pytest.mark.slow
def test_a_forged_challenge_state_is_one_error_line(full, name, change, setup, finished, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(finished[full], out)
    edit(out / STATE_NAME, change)
    code, stdout, err = run_in_process(challenge_eval.main,
                                       challenge_args(setup, out, "--resume", *(["--full"] if full else [])), capsys)
    line = check_error(code, stdout, err, lines=None)
    assert str(out / STATE_NAME) in line and "rerun without --resume" in line, name


@pytest.mark.slow
def test_the_unedited_states_resume_to_the_same_numbers(setup, finished, tmp_path, capsys):
    """The checks refuse only what the search does not write: each finished state, resumed, prints its run again."""
    for full in (False, True):
        extra = ["--full"] if full else []
        code, first, err = run_in_process(challenge_eval.main, challenge_args(setup, tmp_path / f"fresh{full}", *extra),
                                          capsys)
        assert code == 0, err
        code, again, err = run_in_process(challenge_eval.main,
                                          challenge_args(setup, finished[full], "--resume", *extra), capsys)
        assert code == 0 and again == first and first.startswith("Summary: "), err


@pytest.fixture(scope="module")
def in9_state(setup, tmp_path_factory):
    data, model = setup
    out = tmp_path_factory.mktemp("in9")
    run_command(in9_eval.main, ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint",
                                "--eval-dataset", "all",
                                "--output-dir", str(out), *QUIET])
    return out


IN9_FORGERIES = {
    "one prediction too many": lambda s: s["done"]["only_bg_t"].append(0),
    "predictions of class 42": lambda s: s["done"]["original"].__setitem__(0, 42),
    "predictions as text": lambda s: s["done"]["original"].__setitem__(0, "dog"),
    "predictions as fractions": lambda s: s["done"]["original"].__setitem__(0, 0.5),
    "predictions of another shard": lambda s: s["done"]["original"].__setitem__(0, -2),
    "a variation that does not exist": lambda s: s["done"].update(everything=[0] * 18),
    "no predictions at all": lambda s: s.update(done=[]),
}


@pytest.mark.parametrize("name, change", IN9_FORGERIES.items())
@pytest.mark.slow
def test_a_forged_in9_state_is_one_error_line(name, change, setup, in9_state, tmp_path, capsys):
    data, model = setup
    out = tmp_path / "out"
    shutil.copytree(in9_state, out)
    state = json.loads((out / "in9_state.json").read_text())
    change(state)
    (out / "in9_state.json").write_text(json.dumps(state))
    code, stdout, err = run_in_process(in9_eval.main, ["--data-path", str(data), "--checkpoint", str(model),
                                                       "--trust-checkpoint", "--eval-dataset", "all",
                                                       "--output-dir", str(out), "--resume", *QUIET], capsys)
    line = check_error(code, stdout, err, lines=None)
    assert "in9_state.json" in line and "rerun without --resume" in line, name


@pytest.fixture(scope="module")
def training_state(tmp_path_factory):
    """A finished 1-epoch run of train.py (3 steps of 6 images, AdamW), its resume state kept."""
    root = tmp_path_factory.mktemp("train")
    data = synthetic.generate(root / "data", per_class=2, seed=3, split="train").root
    out = root / "out"
    argv = ["--data-path", data, "--weights", "none", "--epochs", 1, "--batch-size", 6, "--output-dir", out, *TINY]
    run_command(__import__("train").main, [str(a) for a in argv])
    return argv, out


def optimizer_state_of_another_shape(state):
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 3)


TRAINING_FORGERIES = {
    "a negative step": lambda s: s.update(step=-5),
    "a step past the run's end": lambda s: s.update(step=10**9),
    "a step that is text": lambda s: s.update(step="3"),
    "a weight of another shape": lambda s: s["model"].update({next(iter(s["model"])): torch.zeros(2, 2)}),
    "a weight missing": lambda s: s["model"].pop(next(iter(s["model"]))),
    "an optimiser state of another shape": optimizer_state_of_another_shape,
    "an optimiser of other parameters": lambda s: s["optimizer"]["param_groups"][0].update(params=[0]),
    "a schedule at another step": lambda s: s["schedule"].update(last_epoch=1000),
    "no schedule": lambda s: s.pop("schedule"),
}


def mid_run(change):
    """`change` made to the state rewound to step 1 (its schedule too), as one saved mid-run: its resume trains."""
    def forge(state):
        state["step"] = 1
        state["schedule"].update(last_epoch=1, _step_count=2)
        change(state)
    return forge


def first_group(**settings):
    return mid_run(lambda s: s["optimizer"]["param_groups"][0].update(settings))


TRAINING_FORGERIES.update({  # each a traceback in training before (a setting torch's load_state_dict takes as it is)
    "a schedule whose method is a number": mid_run(lambda s: s["schedule"].update(get_lr=0)),
    "a schedule's base rate that is text": mid_run(lambda s: s["schedule"].update(base_lrs=["x"])),
    "an optimiser's betas that are text": first_group(betas="xx"),
    "an optimiser's weight decay that is None": first_group(weight_decay=None),
    "an optimiser's rate that is text": first_group(lr="x"),
    "an optimiser's step count that is text": mid_run(lambda s: s["optimizer"]["state"][0].update(step="x")),
    "an optimiser's decay that is a tensor": first_group(weight_decay=torch.zeros(2)),
})


@pytest.mark.parametrize("name, change", TRAINING_FORGERIES.items())
@pytest.mark.slow
def test_a_forged_training_state_is_one_error_line_and_keeps_the_checkpoint(name, change, training_state, tmp_path,
                                                                            capsys):
    argv, finished_out = training_state
    out = tmp_path / "out"
    shutil.copytree(finished_out, out)
    state = torch.load(out / TRAINING_STATE, weights_only=True)
    change(state)
    torch.save(state, out / TRAINING_STATE)
    checkpoint = (out / "checkpoint.pt").read_bytes()
    code, stdout, err = run_train([*[str(out) if a == finished_out else a for a in argv], "--resume"], capsys)
    line = check_error(code, stdout, err, lines=None)
    assert TRAINING_STATE in line and "rerun without --resume" in line, name
    assert (out / "checkpoint.pt").read_bytes() == checkpoint  # nothing already made is lost


@pytest.fixture(scope="module")
def swa_state(tmp_path_factory):
    """A finished 2-epoch run of train.py with --swa (6 steps of 6 images), its resume state holding SWALR's."""
    root = tmp_path_factory.mktemp("swa")
    data = synthetic.generate(root / "data", per_class=2, seed=3, split="train").root
    out = root / "out"
    argv = ["--data-path", data, "--weights", "none", "--epochs", 2, "--batch-size", 6, "--swa", "--output-dir", out,
            *TINY]
    run_command(__import__("train").main, [str(a) for a in argv])
    return argv, out


def test_a_forged_swa_schedule_is_one_error_line(swa_state, tmp_path, capsys):
    """SWALR's saved state sets its attributes as they are (a method replaced by a number: a traceback when the
    resumed run stepped it)."""
    argv, finished_out = swa_state
    out = tmp_path / "out"
    shutil.copytree(finished_out, out)
    state = torch.load(out / TRAINING_STATE, weights_only=True)
    state["step"] = 5
    state["schedule"].update(last_epoch=state["swa"]["scheduler"]["last_epoch"])
    state["swa"]["scheduler"]["get_lr"] = 0
    torch.save(state, out / TRAINING_STATE)
    code, stdout, err = run_train([*[str(out) if a == finished_out else a for a in argv], "--resume"], capsys)
    line = check_error(code, stdout, err, lines=None)
    assert TRAINING_STATE in line and "get_lr" in line


def lying_header(path: Path) -> None:
    """The state's verdicts replaced by a stored .npy member whose header claims 10^12 of them (8 bytes follow)."""
    import zipfile  # noqa: PLC0415
    with np.load(path) as z:
        arrays = dict(z)
    arrays.pop("verdict")
    np.savez(path, **arrays)
    header = {"descr": "|i1", "fortran_order": False, "shape": (10**12,)}
    buffer = __import__("io").BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_STORED) as archive:
        archive.writestr("verdict.npy", buffer.getvalue() + bytes(8))


@pytest.mark.parametrize("name", ["compressed", "a header claiming 10^12 verdicts"])
def test_a_state_archive_that_does_not_hold_what_it_claims_is_one_error_line(name, setup, finished, tmp_path, capsys):
    """The toolkit writes its archives uncompressed: an array is read only when its bytes are all there, so a small
    file cannot make a huge allocation."""
    out = tmp_path / "out"
    shutil.copytree(finished[False], out)
    if name == "compressed":
        with np.load(out / STATE_NAME) as z:
            arrays = dict(z)
        np.savez_compressed(out / STATE_NAME, **arrays)
    else:
        lying_header(out / STATE_NAME)
    code, stdout, err = run_in_process(challenge_eval.main, challenge_args(setup, out, "--resume"), capsys)
    line = check_error(code, stdout, err, lines=None)
    assert str(out / STATE_NAME) in line and "rerun without --resume" in line


def test_a_training_log_line_whose_step_is_not_a_number_is_dropped_on_resume(training_state, tmp_path, capsys):
    """The resumed run keeps the log's lines up to its step: one whose step is text was compared with it (a
    traceback); it is dropped, as a line cut short is."""
    argv, finished_out = training_state
    out = tmp_path / "out"
    shutil.copytree(finished_out, out)
    log = out / "train_log.jsonl"
    log.write_text(log.read_text() + json.dumps({"step": "3"}) + "\n")
    code, _, err = run_train([*[str(out) if a == finished_out else a for a in argv], "--resume"], capsys)
    assert code == 0, err
    assert '"step": "3"' not in log.read_text()
