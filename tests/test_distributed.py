"""torchrun: two processes on the gloo backend write exactly what one process writes, for both scripts and the
zoo, all under tests.collective_guard; every collective puts its tensors where NCCL needs them."""

from __future__ import annotations

import ast
import json
import logging
import os
import shutil
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import challenge_eval
import in9_eval
from tests import collective_guard
from tests.helpers import TinyCNN, run_in_process, run_in_processes, save_torchscript
from tools import distributed, zoo
from tools.challenge import STATE_NAME, CompositePredictor, SearchState
from tools.challenge.scheduler import split_untested
from tools.data import synthetic
from tools.runtime import Runtime

pytestmark = pytest.mark.slow  # end to end: torchrun-style process groups, every command across processes

REPO = Path(__file__).resolve().parents[1]
TIMING = ("wall_time_s", "composites_per_s", "composites_evaluated")  # cost, not results


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    data = synthetic.generate(root / "bg", per_class=3, seed=5).root
    models = {}
    for name, module in (("cnn", TinyCNN(9, seed=3)), ("color", synthetic.ColorEvidenceModel(9))):
        models[name] = root / f"{name}.ts"
        save_torchscript(module, models[name])
    return data, models


def guarded(processes: int) -> list[str]:
    """The command prefix that runs a script (or `-m MODULE`) in `processes` torchrun processes under the guard."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}", "-m"]
    return [*(launcher if processes > 1 else [sys.executable, "-m"]), "tests.collective_guard"]


def flags(out: Path, *args) -> list[str]:
    return ["--device", "cpu", "--no-progress", "--log-level", "WARNING", "--output-dir", str(out), "--results-file",
            str(out / "results.json"), *map(str, args)]


def run(script: str, out: Path, processes: int, *args) -> str:
    command = [*guarded(processes), str(REPO / script), *flags(out, *args)]
    proc = collective_guard.launch(command, cwd=REPO, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def run_here(main, argv: list[str], capsys, monkeypatch) -> str:
    """The one-process reference: the command's main in this process, under the guard (one thread, as each
    torchrun process has, from the tests' `one_thread`); a process of its own would only add its start-up."""
    collective_guard.install(monkeypatch.setattr)
    code, out, err = run_in_process(main, argv, capsys)
    assert code == 0, err[-3000:]
    return out


def results(out: Path) -> dict:
    payload = json.loads((out / "results.json").read_text())
    return {k: v for k, v in payload.items() if k not in TIMING}


@pytest.mark.parametrize("model,full", [("color", False), ("cnn", True)])  # robust and vulnerable; every pair
def test_challenge_two_processes_equal_one(model, full, setup, tmp_path, capsys, monkeypatch, one_thread):
    data, models = setup
    args = ["--data-path", data, "--checkpoint", models[model], "--trust-checkpoint", "--no-cache", "--batch-size", 5]
    if full:
        args += ["--full", "--analysis"]
    outputs = {}
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        args_n = [*args, "--per-foreground-csv", out / "fg.csv"]
        stdout = (run_here(challenge_eval.main, flags(out, *args_n), capsys, monkeypatch) if n == 1
                  else run("challenge_eval.py", out, n, *args_n))
        outputs[n] = (stdout, results(out), (out / "fg.csv").read_text())
    assert outputs[1] == outputs[2]
    assert outputs[1][0].startswith("Summary: ")
    if full:
        one, two = tmp_path / "n1", tmp_path / "n2"
        assert np.array_equal(np.load(one / "predictions.npy"), np.load(two / "predictions.npy"))
        for name in ("foregrounds.csv", "backgrounds.csv", "asr.csv", "top_backgrounds.csv"):
            assert (one / name).read_bytes() == (two / name).read_bytes(), name
        summaries = [json.loads((out / "analysis.json").read_text()) for out in (one, two)]
        assert [{k: v for k, v in a.items() if k != "output_dir"} for a in summaries][0] == \
               {k: v for k, v in summaries[1].items() if k != "output_dir"}


def test_in9_two_processes_equal_one(setup, tmp_path, capsys, monkeypatch, one_thread):
    data, models = setup
    args = ["--data-path", data, "--checkpoint", models["cnn"], "--trust-checkpoint", "--eval-dataset", "all",
            "--categories",
            "--batch-size", 5]
    one = run_here(in9_eval.main, flags(tmp_path / "n1", *args), capsys, monkeypatch)
    two = run("in9_eval.py", tmp_path / "n2", 2, *args)
    assert one == two and one.startswith("Accuracy on original is ")
    assert results(tmp_path / "n1") == results(tmp_path / "n2")


def test_zoo_two_processes_equal_one(setup, tmp_path, capsys, monkeypatch, one_thread):
    data, models = setup
    outputs = []
    for n in (1, 2):
        out = tmp_path / f"zoo{n}"
        argv = ["--models", f"file:{models['color']}", "--trust-checkpoint", "--data-path", str(data), "--device",
                "cpu", "--no-progress", "--no-cache", "--batch-size", "5", "--output-dir", str(out), "--log-level",
                "WARNING"]
        if n == 1:
            run_here(zoo.main, argv, capsys, monkeypatch)
        else:
            proc = collective_guard.launch([*guarded(n), "-m", "tools.zoo", *argv], cwd=REPO, timeout=300,
                                           env={**os.environ, "OMP_NUM_THREADS": "1"})
            assert proc.returncode == 0, proc.stderr[-3000:]
        (path,) = (out / "models").glob("*.json")
        payload = json.loads(path.read_text())
        payload["challenge"] = {k: v for k, v in payload["challenge"].items() if k not in TIMING}
        outputs.append(payload)
    assert outputs[0] == outputs[1]


# ----------------------------------------------------------------------------------------------------------
# Where collectives' tensors live. No GPU here, so the NCCL rule is checked three ways: the toolkit talks to
# torch.distributed only in tools/distributed.py (read from the source); that module, told its group is NCCL,
# puts every collective's tensors on the run's device (a stand-in for the GPU); and the runs above go through
# tests.collective_guard, which stops any collective called around that module.

STAND_IN_GPU = torch.device("meta")  # not the CPU: where a GPU's tensors would be
CHOKEPOINT = REPO / "tools" / "distributed.py"


class Reached(Exception):
    """A fake collective was handed its tensors."""


def _chokepoint_calls(device: torch.device) -> dict:
    """Each function of tools.distributed that issues a collective, called for a run on `device`."""
    group = distributed.ProcessGroup(1, 2, 1)
    return {"all_reduce": lambda: distributed.all_reduce(np.arange(3.0), "sum", device),
            "broadcast": lambda: distributed.broadcast(np.arange(3), group, device),
            "all_gather_floats": lambda: distributed.all_gather_floats(1.5, device),
            "barrier": group.barrier}


def _collective_callers(path: Path) -> set[str]:
    """The functions (and methods) in a source file that call a torch.distributed collective."""
    callers = set()
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr in collective_guard.COLLECTIVES for node in ast.walk(function)):
                callers.add(function.name)
    return callers


def _talks_to_torch_distributed(tree: ast.AST) -> list[int]:
    """Line numbers that import torch.distributed (in any spelling) or reach it as torch.distributed."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            hit = any(a.name == "torch.distributed" or a.name.startswith("torch.distributed.") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            hit = (module == "torch.distributed" or module.startswith("torch.distributed.")
                   or (module == "torch" and any(a.name == "distributed" for a in node.names)))
        else:
            hit = (isinstance(node, ast.Attribute) and node.attr == "distributed"
                   and isinstance(node.value, ast.Name) and node.value.id == "torch")
        if hit:
            lines.append(node.lineno)
    return lines


def test_only_tools_distributed_talks_to_torch_distributed():
    offenders = []
    for path in sorted([*(REPO / "tools").rglob("*.py"), *REPO.glob("*.py")]):
        if path != CHOKEPOINT:
            offenders += [f"{path.relative_to(REPO)}:{line}"
                          for line in _talks_to_torch_distributed(ast.parse(path.read_text(), str(path)))]
    assert not offenders, f"torch.distributed used outside tools/distributed.py: {offenders}"
    # and the NCCL test below calls every function of that module that issues a collective
    assert _collective_callers(CHOKEPOINT) <= set(_chokepoint_calls(torch.device("cpu")))


@pytest.fixture
def recorded_collectives(monkeypatch):
    """tools.distributed joined to a group of two whose backend the test sets; its collectives record what they
    are handed (tensors' devices, barrier's device_ids) and stop."""
    seen = []

    def record(*args, **kwargs):
        tensors = [t for value in (*args, *kwargs.values())
                   for t in (value if isinstance(value, list) else [value]) if isinstance(t, torch.Tensor)]
        seen.extend(t.device for t in tensors)
        if kwargs.get("device_ids") is not None:
            seen.extend(torch.device("cuda", i) for i in kwargs["device_ids"])
        raise Reached

    backend = {"name": "nccl"}
    monkeypatch.setattr(distributed, "_joined", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["name"])
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for name in collective_guard.COLLECTIVES:
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, record)
    return seen, backend


@pytest.mark.parametrize("name", list(_chokepoint_calls(torch.device("cpu"))))
def test_every_collective_puts_its_tensors_where_the_backend_needs_them(name, recorded_collectives):
    seen, backend = recorded_collectives
    for backend["name"], device, expected in (("nccl", STAND_IN_GPU, STAND_IN_GPU),  # the run's GPU
                                              ("gloo", STAND_IN_GPU, torch.device("cpu"))):  # gloo: the CPU
        seen.clear()
        with pytest.raises(Reached):
            _chokepoint_calls(device)[name]()
        if name == "barrier":  # no tensor of its own: under NCCL it names this process's GPU (local rank 1)
            assert seen == ([torch.device("cuda", 1)] if backend["name"] == "nccl" else []), backend
        else:
            assert seen and all(d == expected for d in seen), (backend, seen)


def test_the_guard_stops_collectives_around_tools_distributed_and_tensors_off_their_device(tmp_path, monkeypatch):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        collective_guard.install(monkeypatch.setattr)
        tensor = torch.ones(2)
        from_the_toolkit = compile("dist.all_reduce(tensor)", str(REPO / "tools" / "somewhere.py"), "exec")
        with pytest.raises(collective_guard.CollectiveRuleBroken, match="somewhere.py calls torch.distributed.all_r"):
            exec(from_the_toolkit, {"dist": dist, "tensor": tensor})  # noqa: S102 (the test's own code)
        with pytest.raises(collective_guard.CollectiveRuleBroken, match="tensor on meta under gloo"):
            dist.all_reduce(torch.ones(2, device="meta"))
        # through tools.distributed (and from code outside the toolkit, such as torch's or this test's): allowed
        assert distributed.all_reduce(np.array([2.0, 3.0]), "sum", torch.device("cpu")).tolist() == [2.0, 3.0]
        assert distributed.all_gather_floats(1.5, torch.device("cpu")) == [1.5]
        dist.all_reduce(tensor)
    finally:
        distributed.cleanup()  # as the toolkit leaves a gloo group (the wait torch < 2.8 needs)


def test_zoo_failure_in_one_process_fails_the_model_in_every_process(setup, tmp_path, capsys, one_thread):
    """A model failing on one rank only, in each phase in turn (tests/zoo_failures.py): no process is left waiting
    in a collective, each is reported failed, a model done before is skipped by both, and the model after them
    gets the numbers of the one done before (the same weights, run by one process at torchrun's one thread, as
    the processes run)."""
    data, models = setup
    words = ["fail-load", "fail-in9", "done-before", "fail-decode", "fail-search", "fail-save", "fail-write", "works"]
    specs = {}
    for word in words:
        shutil.copyfile(models["color"], tmp_path / f"color-{word}.ts")
        specs[word] = f"file:{tmp_path / f'color-{word}.ts'}"
    common = ["--data-path", str(data), "--device", "cpu", "--no-progress", "--no-cache", "--batch-size", "5",
              "--log-level", "WARNING", "--no-leaderboard", "--output-dir", str(tmp_path / "zoo"), "--trust-checkpoint"]
    code, _, err = run_in_process(zoo.main, [*common, "--models", specs["done-before"]], capsys)
    assert code == 0, err
    # no second attempt (collective_guard.launch): a rerun would find the first attempt's results in --output-dir
    proc = subprocess.run([*guarded(2), "-m", "tests.zoo_failures", "--models", ",".join(specs.values()), *common],
                          cwd=REPO, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0, proc.stderr[-3000:]
    failing = [word for word in words if word.startswith("fail-")]
    lines = proc.stdout.splitlines()
    assert [line.split(": ")[1] for line in lines[:len(words)]] == \
        ["failed" if word in failing else "skipped" if word == "done-before" else "done" for word in words], \
        proc.stdout + proc.stderr[-3000:]
    assert lines[len(words)] == f"2 of 8 models done; failed: {', '.join(specs[word] for word in failing)}"
    for word in failing:  # the other process says which one failed
        assert f"ERROR: {specs[word]}: process {0 if word in ('fail-save', 'fail-write') else 1} of 2 failed" \
            in proc.stderr, proc.stderr[-3000:]
    written = {json.loads(path.read_text())["model"]: json.loads(path.read_text())
               for path in (tmp_path / "zoo" / "models").glob("*.json")}
    assert sorted(written) == sorted([specs["done-before"], specs["works"]])
    one, two = written[specs["done-before"]], written[specs["works"]]
    for run in ("in9", "challenge"):
        assert copy_independent(two[run]) == copy_independent(one[run])


def copy_independent(run: dict) -> dict:
    """A run's results less what differs between two copies of one checkpoint: the timing and the file's path (the
    model's identity is its content's: the same)."""
    kept = {k: v for k, v in run.items() if k not in TIMING}
    kept["provenance"] = {k: v for k, v in run["provenance"].items() if k != "checkpoint"}
    record = kept["provenance"]["model_record"]
    kept["provenance"]["model_record"] = {**record, "files": {role: {k: v for k, v in entry.items() if k != "path"}
                                                              for role, entry in record["files"].items()}}
    return kept


def test_agree_votes_only_among_the_runs_own_processes(monkeypatch):
    """A run of one process inside a joined group (rank 0 evaluating alone after training) votes with nobody; a
    run shared by the group votes once per block."""
    votes = []
    monkeypatch.setattr(distributed, "_joined", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(distributed, "all_reduce", lambda array, op, device: votes.append(array.copy()) or array)
    with distributed.agree(distributed.ProcessGroup(), torch.device("cpu")):
        pass
    assert votes == []
    with distributed.agree(distributed.ProcessGroup(0, 2, 0), torch.device("cpu")):
        pass
    assert len(votes) == 1 and votes[0].tolist() == [0, 0]


# ----------------------------------------------------------------------------------------------------------
# Waiting in a collective: the process group's timeout (torch's NCCL default, 10 minutes, aborts a job whose
# processes wait longer for one another), and the search's work shared and saved so that no wait is long.

def _command(name: str, data: Path, model: Path, tmp_path: Path):
    """(main, argv) of a command that may run under torchrun, with the flags it needs."""
    import challenge_eval  # noqa: PLC0415
    import in9_eval  # noqa: PLC0415
    import train  # noqa: PLC0415
    common = ["--data-path", str(data), "--device", "cpu", "--no-progress", "--log-level", "WARNING",
              "--output-dir", str(tmp_path / name)]
    common = [*common, "--trust-checkpoint"]  # the model is TorchScript
    return {"in9_eval": (in9_eval.main, [*common, "--checkpoint", str(model)]),
            "challenge_eval": (challenge_eval.main, [*common, "--checkpoint", str(model), "--no-cache"]),
            "zoo": (zoo.main, [*common, "--models", f"file:{model}", "--no-cache"]),
            "train": (train.main, [*common, "--checkpoint", str(model)])}[name]


COMMANDS = ("in9_eval", "challenge_eval", "zoo", "train")


@pytest.mark.parametrize("flag,minutes", [((), distributed.DEFAULT_TIMEOUT_MINUTES), (("--dist-timeout", "0.5"), 0.5)],
                         ids=["default", "flag"])
@pytest.mark.parametrize("name", COMMANDS)
def test_the_timeout_reaches_the_process_group(name, flag, minutes, setup, tmp_path, monkeypatch):
    """Each command, as rank 0 of two, joins the group with --dist-timeout (or its default), not torch's 10
    minutes that abort a run whose processes wait longer for one another."""
    data, models = setup
    joined = []

    def init_process_group(*args, **kwargs):
        joined.append(kwargs)
        raise Reached

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for variable, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(variable, value)
    main, argv = _command(name, data, models["color"], tmp_path)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        with pytest.raises(Reached):
            main([*argv, *flag])
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert len(joined) == 1 and joined[0].get("timeout") == timedelta(minutes=minutes), joined


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf", "soon"])
@pytest.mark.parametrize("name", COMMANDS)
def test_a_timeout_that_is_not_a_positive_number_of_minutes_is_refused(name, value, setup, tmp_path, capsys):
    data, models = setup
    main, argv = _command(name, data, models["color"], tmp_path)
    with pytest.raises(SystemExit) as exc:  # argparse's refusal: one error line
        main([*argv, "--dist-timeout", value])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"error: argument --dist-timeout: {value!r} "
                          "is not a positive, finite number of minutes; see ")
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("parts", [2, 3, 5])
@pytest.mark.parametrize("done", ["concentrated", "scattered", "none", "all", "nearly all"])
def test_the_pairs_left_are_split_into_equal_runs(done, parts):
    """split_untested against the pairs left listed one by one: each part is a run of them, in order, and the parts'
    sizes differ by one at most, wherever the work already done lies."""
    rng = np.random.default_rng(parts)
    tested = np.zeros((11, 7), bool)
    if done == "concentrated":  # a resumed run: the first process's old share of rows done, and more
        tested[:7] = True
    elif done == "scattered":  # a run saved mid-way by several processes
        tested = rng.random(tested.shape) < 0.6
    elif done == "all":
        tested[:] = True
    elif done == "nearly all":  # fewer pairs left than parts
        tested[:] = True
        tested.flat[[5, 40]] = False
    bounds = split_untested(tested, parts)
    left = np.flatnonzero(~tested.ravel())
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == tested.size and (np.diff(bounds) >= 0).all()
    shares = [left[(left >= start) & (left < stop)] for start, stop in zip(bounds[:-1], bounds[1:])]
    assert np.array_equal(np.concatenate(shares), left)
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1, sizes


def _shared_challenge(data: Path, checkpoint: Path, output_dir: Path, full: bool, resume: bool) -> dict:
    """run_challenge in this process of a gloo group, saving the state at every chance (save_every 0): what it
    found, how many pairs this process tested, and (rank 0, which writes) the pairs left in the round at each save,
    whose state is copied to save-N.npz beside it."""
    from tools.challenge import UNKNOWN, CompositePredictor  # noqa: PLC0415
    from tools.runtime import Runtime  # noqa: PLC0415
    cpu = torch.device("cpu")
    runtime = Runtime(cpu, group=distributed.setup(cpu))
    tested, left = [0], []
    predict, save = CompositePredictor.predict_pairs, SearchState.save

    def counted(self, pairs):
        tested[0] += len(pairs)
        return predict(self, pairs)

    def copied(self, path, key):
        save(self, path, key)
        if self.matrix is not None:
            left.append(int((~self.tested).sum()))
        else:
            f, b = self.worklist[:, 0], self.worklist[:, 1]
            left.append(int((~self.tested[f, b] & (self.verdict[f] == UNKNOWN)).sum()))
        shutil.copyfile(path, Path(path).with_name(f"save-{len(left) - 1}.npz"))

    CompositePredictor.predict_pairs, SearchState.save = counted, copied  # a process of its own: nothing to undo
    result = _challenge(data, checkpoint, output_dir, full, resume, runtime)
    return {"found": _findings(result.state), "tested": tested[0], "left": left}


def _challenge(data: Path, checkpoint: Path, output_dir: Path, full: bool, resume: bool, runtime):
    """The challenge with the state saved at every chance (save_every 0)."""
    from tools.challenge import ChallengeConfig, list_challenge_files, run_challenge  # noqa: PLC0415
    from tools.models.sources import load_model  # noqa: PLC0415
    config = ChallengeConfig(batch_size=5 if full else 2, full=full, save_every=0.0, progress=False)
    return run_challenge(load_model(trust=True, checkpoint=checkpoint), runtime, list_challenge_files(data, 1), config,
                         output_dir=output_dir,
                         resume=resume, workers=1)


def _findings(state) -> dict:
    """What a challenge run found, as tensors: verdicts, fooling backgrounds and predictions, the --full matrix."""
    found = {name: torch.from_numpy(np.asarray(getattr(state, name)).astype(np.int64))
             for name in ("verdict", "fool_bg", "fool_pred")}
    found["matrix"] = torch.zeros(0) if state.matrix is None else torch.from_numpy(state.matrix.astype(np.int64))
    return found


@pytest.fixture(scope="module")
def uninterrupted(setup, tmp_path_factory):
    """Uninterrupted runs shared by two gloo processes, by --full (the CNN, every pair) or not (the colour model,
    robust and vulnerable foregrounds): (output folder, each process's `_shared_challenge`)."""
    data, models = setup
    runs = {}

    def run_once(full: bool):
        if full not in runs:
            out = tmp_path_factory.mktemp("full" if full else "search")
            runs[full] = out, run_in_processes(_shared_challenge, 2, out, data, models["cnn" if full else "color"],
                                               out, full, False)
        return runs[full]

    return run_once


def _same_findings(found: list[dict], whole: list[dict]) -> None:
    for rank, run in enumerate(found):
        for name, value in whole[0]["found"].items():
            assert torch.equal(run[name], value), (rank, name)


@pytest.mark.parametrize("full", [False, True], ids=["search", "full"])
def test_two_processes_save_mid_run_and_resume_from_there_to_the_uninterrupted_result(full, uninterrupted, setup,
                                                                                     tmp_path, monkeypatch):
    """Under torchrun the state is saved as in one process, mid-round and mid-matrix (not only at a round's end,
    nor only at the end of --full): a run stopped right after such a save resumes, with two processes or one,
    into the uninterrupted result, testing only what was left."""
    data, models = setup
    model = models["cnn" if full else "color"]
    out, whole = uninterrupted(full)
    left = whole[0]["left"]
    mid_run = [n for n, count in enumerate(left) if count > 0]
    assert mid_run, f"rank 0 saved the state only where nothing was left in the round (pairs left at each save: {left})"
    save = mid_run[len(mid_run) // 2]
    for processes in (2, 1):
        (tmp_path / f"stopped{processes}").mkdir()
        shutil.copyfile(out / f"save-{save}.npz", tmp_path / f"stopped{processes}" / STATE_NAME)
    two = run_in_processes(_shared_challenge, 2, tmp_path, data, model, tmp_path / "stopped2", full, True)
    _same_findings([run["found"] for run in two], whole)
    assert sum(run["tested"] for run in two) < sum(run["tested"] for run in whole)
    tested = []
    predict = CompositePredictor.predict_pairs
    monkeypatch.setattr(CompositePredictor, "predict_pairs", lambda self, pairs: tested.append(len(pairs)) or
                        predict(self, pairs))
    one = _challenge(data, model, tmp_path / "stopped1", full, True, Runtime(torch.device("cpu")))
    _same_findings([_findings(one.state)], whole)
    assert sum(tested) < sum(run["tested"] for run in whole)
    if full:  # exactly the pairs left, whichever of them the processes had tested
        assert sum(tested) == sum(run["tested"] for run in two) == left[save]


def test_a_resumed_full_run_shares_what_is_left_evenly(uninterrupted, setup, tmp_path):
    """A --full state whose work done lies in the first process's old share of rows (three fifths of the rows, as
    one process leaves it): each of two processes tests half of the pairs left, within one, and the result is
    the uninterrupted one."""
    data, models = setup
    out, whole = uninterrupted(True)
    with np.load(out / STATE_NAME) as saved:
        key, (n_fg, n_bg) = bytes(saved["key"]).decode(), saved["shape"]
    final = SearchState.load(out / STATE_NAME, key, n_fg, n_bg, full=True)
    rows = 3 * n_fg // 5
    state = SearchState.fresh(n_fg, n_bg, final.bg_pred, full=True)
    state.tested[:rows], state.matrix[:rows] = True, final.matrix[:rows]
    state.evaluated = state.position = rows * n_bg
    (tmp_path / "stopped").mkdir()
    state.save(tmp_path / "stopped" / STATE_NAME, key)
    resumed = run_in_processes(_shared_challenge, 2, tmp_path, data, models["cnn"], tmp_path / "stopped", True, True)
    _same_findings([run["found"] for run in resumed], whole)
    shares = [run["tested"] for run in resumed]
    assert sum(shares) == (n_fg - rows) * n_bg and max(shares) - min(shares) <= 1, shares


@pytest.mark.parametrize(("backend", "version", "waits"), [("gloo", "2.6.0", True), ("gloo", "2.7.1", True),
                                                          ("gloo", "2.8.0", False), ("nccl", "2.6.0", False),
                                                          ("cpu:gloo,cuda:nccl", "2.7.0", True)])
def test_leaving_a_gloo_group_before_torch_2_8_lets_its_workers_drop_finished_work_first(backend, version, waits,
                                                                                         monkeypatch):
    """torch < 2.8 destroys a gloo group holding the GIL while its worker threads may need it (pytorch#154976):
    cleanup waits a moment, the GIL released, before destroying it; the order matters, not the time."""
    from torch.torch_version import TorchVersion  # noqa: PLC0415
    events = []
    monkeypatch.setattr(torch, "__version__", TorchVersion(version))
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(distributed.dist, "destroy_process_group", lambda: events.append("destroy"))
    monkeypatch.setattr(distributed.time, "sleep", lambda seconds: events.append("sleep"))
    distributed.cleanup()
    assert events == (["sleep", "destroy"] if waits else ["destroy"])
