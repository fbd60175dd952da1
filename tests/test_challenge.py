"""The challenge engine against the brute-force reference, under every mode, order and interruption."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import challenge_eval
from tests.challenge_reference import reference_matrix, reference_verdicts
from tests.helpers import TinyCNN, run_in_process, save_torchscript
from tools import challenge
from tools.challenge import ChallengeConfig, Criterion, Scheduler, run_challenge
from tools.challenge.run import state_key
from tools.data import synthetic
from tools.data.decoders import Decoder
from tools.in9 import IMAGENET_MEAN, IMAGENET_STD, IN9_MEAN, IN9_STD
from tools.models.sources import load_model
from tools.results.matrix import write_matrix
from tools.runtime import Runtime
from tools.runtime.inflight import IN_FLIGHT

REPO = Path(__file__).resolve().parents[1]
CPU = Runtime(torch.device("cpu"))


MODELS = {
    "color9": lambda: synthetic.ColorEvidenceModel(9),
    "color1000": lambda: synthetic.ColorEvidenceModel(1000, unmapped_score=0.3),
    "cnn9": lambda: TinyCNN(9, seed=3),
    "stride9": lambda: synthetic.ColorEvidenceModel(9, sampling="stride"),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("chal") / "bg", per_class=3, seed=5).root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chal-models")
    out = {}
    for name, make in MODELS.items():
        module = make().eval()
        path = folder / f"{name}.ts"
        save_torchscript(module, path)
        out[name] = (module, path)
    return out


@pytest.fixture(scope="module")
def references(data, models):
    out = {}
    for name, (module, _) in models.items():
        nine = name.endswith("9")
        out[name] = reference_matrix(data, module, *((IN9_MEAN, IN9_STD) if nine else (IMAGENET_MEAN, IMAGENET_STD)))
    return out


def engine(path, data, tmp_path, **config):
    loaded = load_model(trust=True, checkpoint=path)
    cfg = ChallengeConfig(batch_size=config.pop("batch_size", 7), progress=False, **config)
    return run_challenge(loaded, CPU, challenge.list_challenge_files(data, 2), cfg, output_dir=tmp_path, workers=2)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("criterion", list(Criterion))
@pytest.mark.slow
def test_verdicts_equal_brute_force(name, criterion, data, models, references, tmp_path):
    matrix, fg_labels, bg_labels = references[name]
    expected = reference_verdicts(matrix, fg_labels, bg_labels, criterion.value)
    result = engine(models[name][1], data, tmp_path, criterion=criterion)
    got = result.state.verdict == challenge.VULNERABLE
    assert got.tolist() == expected.tolist()
    assert 0 < expected.sum() < len(expected) or name == "cnn9"  # the colour models give both kinds
    # each reported fooling background really fools, by the reference matrix
    for i in np.nonzero(got)[0]:
        b = result.state.fool_bg[i]
        assert matrix[i, b] == result.state.fool_pred[i]
        if criterion is Criterion.ANY:
            assert matrix[i, b] != fg_labels[i]
        else:
            assert matrix[i, b] == bg_labels[b] != fg_labels[i]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.slow
def test_full_matrix_equals_reference(name, data, models, references, tmp_path):
    matrix, fg_labels, bg_labels = references[name]
    result = engine(models[name][1], data, tmp_path, full=True, batch_size=10)
    assert np.array_equal(result.state.matrix.astype(np.int64), matrix)
    assert result.state.evaluated == matrix.size
    expected = reference_verdicts(matrix, fg_labels, bg_labels, "any")
    assert (result.state.verdict == challenge.VULNERABLE).tolist() == expected.tolist()
    write_matrix(tmp_path / "full", result, data, 9)
    assert np.array_equal(np.load(tmp_path / "full" / "predictions.npy"), matrix.astype(np.int8))


@pytest.mark.parametrize("decoder", list(Decoder))
@pytest.mark.slow
def test_either_decoder_gives_the_references_verdicts_and_matrix(decoder, data, models, references, tmp_path):
    """In fp32, the verdicts and the --full matrix are the brute-force (Pillow) reference's with either decoder."""
    matrix, fg_labels, bg_labels = references["cnn9"]
    files = challenge.list_challenge_files(data, 2)
    files.image_set.decoder = decoder
    result = run_challenge(load_model(trust=True, checkpoint=models["cnn9"][1]), CPU, files,
                           ChallengeConfig(batch_size=10, progress=False, full=True), output_dir=tmp_path, workers=2)
    assert np.array_equal(result.state.matrix.astype(np.int64), matrix)
    expected = reference_verdicts(matrix, fg_labels, bg_labels, "any")
    assert (result.state.verdict == challenge.VULNERABLE).tolist() == expected.tolist()
    assert result.provenance["decoder"]["used"] == decoder.value


def test_unmapped_predictions_are_wrong(references):
    matrix, _, _ = references["color1000"]
    assert (matrix == -1).any(), "the 1000-class model should sometimes predict outside IN-9"


def test_search_does_little_more_than_the_minimum(data, models, references, tmp_path):
    matrix, fg_labels, bg_labels = references["color9"]
    vulnerable = reference_verdicts(matrix, fg_labels, bg_labels, "any")
    result = engine(models["color9"][1], data, tmp_path, batch_size=4)
    minimum = (~vulnerable).sum() * matrix.shape[1] + vulnerable.sum()
    assert minimum <= result.state.evaluated <= 1.3 * minimum


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.slow
def test_verdicts_do_not_depend_on_background_order(seed, data, models, references, tmp_path, monkeypatch):
    matrix, fg_labels, bg_labels = references["color9"]
    expected = reference_verdicts(matrix, fg_labels, bg_labels, "any")
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(Scheduler, "scores", lambda self: rng.random((9, self.n_bg)))
    result = engine(models["color9"][1], data, tmp_path, batch_size=5)
    assert (result.state.verdict == challenge.VULNERABLE).tolist() == expected.tolist()


def interrupt_at_ninth_batch(path, data, cfg, output_dir, monkeypatch) -> None:
    """A run stopped by Ctrl-C as its ninth batch of composites starts (its state saved after every batch)."""
    calls = {"n": 0}
    original = challenge.CompositePredictor.predict_pairs

    def interrupted(self, pairs):
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return original(self, pairs)

    monkeypatch.setattr(challenge.CompositePredictor, "predict_pairs", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_challenge(load_model(trust=True, checkpoint=path), CPU, challenge.list_challenge_files(data, 2), cfg,
                      output_dir=output_dir, workers=2)
    monkeypatch.setattr(challenge.CompositePredictor, "predict_pairs", original)


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.slow
def test_resume_after_interruption_gives_the_uninterrupted_result(full, data, models, tmp_path, monkeypatch):
    path = models["color9"][1]
    whole = engine(path, data, tmp_path / "whole", full=full, batch_size=6)

    cfg = ChallengeConfig(batch_size=6, progress=False, full=full, save_every=0.0)
    interrupt_at_ninth_batch(path, data, cfg, tmp_path / "part", monkeypatch)
    resumed = run_challenge(load_model(trust=True, checkpoint=path), CPU, challenge.list_challenge_files(data, 2), cfg,
                            output_dir=tmp_path / "part",
                            resume=True,
                            workers=2)
    assert resumed.state.verdict.tolist() == whole.state.verdict.tolist()
    assert resumed.state.fool_bg.tolist() == whole.state.fool_bg.tolist()
    assert resumed.state.evaluated == whole.state.evaluated
    if full:
        assert np.array_equal(resumed.state.matrix, whole.state.matrix)


@pytest.mark.slow
def test_a_shared_full_run_resumes_a_single_process_state(data, models, tmp_path, monkeypatch):
    """torchrun resuming an interrupted single-process --full run: its own block of rows, the batches that were in
    flight included, equals the uninterrupted matrix. (Rank 0 of 2 without a real process group: the
    gathering is then the identity, so this process's rows are exactly what it computed.)"""
    from tools.distributed import ProcessGroup  # noqa: PLC0415

    path = models["color9"][1]
    whole = engine(path, data, tmp_path / "whole", full=True, batch_size=6)
    cfg = ChallengeConfig(batch_size=6, progress=False, full=True, save_every=0.0)
    interrupt_at_ninth_batch(path, data, cfg, tmp_path / "part", monkeypatch)
    pending = challenge.SearchState.load(tmp_path / "part" / challenge.STATE_NAME, state_key(whole.key, None),
                                         *whole.state.matrix.shape, full=True).pending
    assert len(pending) == 6 * IN_FLIGHT  # the batches in flight
    shared = Runtime(torch.device("cpu"), group=ProcessGroup(rank=0, world_size=2))
    resumed = run_challenge(load_model(trust=True, checkpoint=path), shared, challenge.list_challenge_files(data, 2),
                            cfg, output_dir=tmp_path / "part",
                            resume=True, workers=2)
    rows = np.array_split(np.arange(len(whole.state.verdict)), 2)[0]
    assert np.array_equal(resumed.state.matrix[rows], whole.state.matrix[rows])


@pytest.mark.slow
def test_resume_refuses_another_runs_state(data, models, tmp_path):
    engine(models["color9"][1], data, tmp_path)
    loaded = load_model(trust=True, checkpoint=models["cnn9"][1])
    with pytest.raises(Exception, match="belongs to another run"):
        run_challenge(loaded, CPU, challenge.list_challenge_files(data, 2), ChallengeConfig(progress=False),
                      output_dir=tmp_path, resume=True)


def test_resume_refuses_a_state_saved_at_another_batch_size(data, models, tmp_path):
    """Rows computed at another batch shape may differ in the last bits: such a state is another run's."""
    engine(models["color9"][1], data, tmp_path, batch_size=6)
    with pytest.raises(Exception, match="belongs to another run"):
        run_challenge(load_model(trust=True, checkpoint=models["color9"][1]), CPU,
                      challenge.list_challenge_files(data, 2),
                      ChallengeConfig(batch_size=8, progress=False), output_dir=tmp_path, resume=True)


@pytest.mark.slow
def test_the_cpu_default_batch_size_is_fixed_not_timed(data, models, tmp_path, monkeypatch):
    """Without --batch-size the CPU runs CPU_BATCH_SIZE, every forward at that one shape: nothing is timed, so
    two runs, a resumed run and every shard run the same shape."""
    from tools.runtime import CPU_BATCH_SIZE, Forward  # noqa: PLC0415
    shapes, run = set(), Forward._run
    monkeypatch.setattr(Forward, "_run", lambda self, piece, rows: shapes.add(self.chunk) or run(self, piece, rows))
    result = run_challenge(load_model(trust=True, checkpoint=models["color9"][1]), CPU,
                           challenge.list_challenge_files(data, 2), ChallengeConfig(batch_size=None, progress=False),
                           output_dir=tmp_path, workers=2)
    assert shapes == {CPU_BATCH_SIZE}
    assert result.provenance["batch_size"] == CPU_BATCH_SIZE


def test_an_out_of_memory_halving_is_in_the_provenance(data, models, tmp_path, monkeypatch):
    """The search's batch size as it ran, and the size it was lowered from: another shape may change the last bits."""
    from tools.runtime import Forward  # noqa: PLC0415
    run = Forward._run

    def small_memory(self, piece, rows):
        if self.chunk > 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return run(self, piece, rows)

    monkeypatch.setattr(Forward, "_run", small_memory)
    result = engine(models["color9"][1], data, tmp_path, batch_size=16)
    assert result.provenance["batch_size"] == 4
    assert result.provenance["batch_size_lowered_from"] == 16


def _summary(stdout: str) -> tuple[int, int]:
    match = re.search(r"Summary: (\d+)/(\d+) \(([\d.]+)%\) are vulnerable foregrounds\.", stdout)
    assert match, stdout
    assert re.search(r"^Challenge accuracy: [\d.]+%$", stdout, re.M)
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("name", ["color9", "color1000"])
@pytest.mark.slow
def test_command_line_prints_the_original_summary(name, data, models, references, tmp_path, capsys):
    """challenge_eval's main in this process (tests/test_distributed.py runs the script as a process, under
    torchrun, and compares what it prints)."""
    matrix, fg_labels, bg_labels = references[name]
    expected = reference_verdicts(matrix, fg_labels, bg_labels, "any")
    args = ["--data-path", str(data), "--checkpoint", str(models[name][1]), "--trust-checkpoint",
            "--device", "cpu", "--output-dir", str(tmp_path), "--no-progress", "--cache-dir", str(tmp_path / "cache"),
            "--results-file", str(tmp_path / "r.json"), "--per-foreground-csv", str(tmp_path / "fg.csv")]
    if name == "color9":
        args.append("--in9")
    code, stdout, _ = run_in_process(challenge_eval.main, args, capsys)
    assert code == 0
    vulnerable, total = _summary(stdout)
    assert (vulnerable, total) == (int(expected.sum()), len(expected))
    pct = 100 * expected.sum() / len(expected)
    assert f"({pct:.2f}%)" in stdout and f"Challenge accuracy: {100 - pct:.2f}%" in stdout
    rows = (tmp_path / "fg.csv").read_text().splitlines()
    assert len(rows) == 1 + len(expected)
    # second run reads the decoded-data cache and agrees
    code, again, again_err = run_in_process(challenge_eval.main, args, capsys)
    assert code == 0
    assert re.search(r"^INFO: (\d+) of \1 image\(s\) read from the decoded-data cache$", again_err, re.M)
    assert "cached at" not in again_err and _summary(again) == (vulnerable, total)


@pytest.mark.slow
def test_kill_9_then_resume(data, tmp_path, capsys):
    """A real process killed with SIGKILL mid-run resumes to the uninterrupted result (the uninterrupted run and
    the resumed one in this process: only the killed run needs a process of its own)."""
    slow = tmp_path / "slow.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9, trunk_width=24, trunk_scale=1e-4), slow)
    base = ["--data-path", str(data), "--checkpoint", str(slow), "--trust-checkpoint", "--device", "cpu",
            "--no-progress", "--no-cache", "--batch-size", "4", "--save-every", "0", "--workers", "1"]
    uninterrupted = ["--output-dir", str(tmp_path / "whole"), "--per-foreground-csv", str(tmp_path / "whole.csv")]
    code, whole, _ = run_in_process(challenge_eval.main, base + uninterrupted, capsys)
    assert code == 0
    state = tmp_path / "killed" / challenge.STATE_NAME
    proc = subprocess.Popen([sys.executable, "challenge_eval.py", *base, "--output-dir", str(tmp_path / "killed")],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not state.exists() and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run finished before it could be killed; use a slower model"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    resume = ["--output-dir", str(tmp_path / "killed"), "--resume",
              "--per-foreground-csv", str(tmp_path / "resumed.csv")]
    code, resumed, err = run_in_process(challenge_eval.main, base + resume, capsys)
    assert code == 0
    assert "resuming from" in err
    assert _summary(resumed) == _summary(whole)
    assert (tmp_path / "resumed.csv").read_text() == (tmp_path / "whole.csv").read_text()


def _break(data: Path, tmp_path: Path) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(data, broken)
    return broken


class _Finished:
    def __init__(self, returncode: int, stderr: str):
        self.returncode, self.stderr = returncode, stderr


@pytest.fixture
def run_cli(capsys):
    """challenge_eval's main, in process (a subprocess per error case would cost seconds each)."""

    def run(data: Path, model: Path, tmp_path: Path) -> _Finished:
        argv = ["--data-path", str(data), "--checkpoint", str(model), "--trust-checkpoint", "--device", "cpu",
                "--no-progress", "--no-cache",
                "--output-dir", str(tmp_path / "out")]
        code = challenge_eval.main(argv)
        return _Finished(code, capsys.readouterr().err)

    return run


def _assert_one_line_error(proc, pattern: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    assert re.search(pattern, errors[0]), errors[0]


def test_mask_without_image(data, models, tmp_path, run_cli):
    broken = _break(data, tmp_path)
    victim = sorted((broken / "original" / "val" / "02_vehicle").iterdir())[0]
    victim.unlink()
    _assert_one_line_error(run_cli(broken, models["color9"][1], tmp_path), rf"without an? \w+ ?\w*: {victim.stem}")


def test_image_without_mask(data, models, tmp_path, run_cli):
    broken = _break(data, tmp_path)
    victim = sorted((broken / "fg_mask" / "val" / "04_carnivore").iterdir())[0]
    victim.unlink()
    _assert_one_line_error(run_cli(broken, models["color9"][1], tmp_path), rf"without an? \w+ ?\w*: {victim.stem}")


@pytest.mark.parametrize("which", [0, -1])  # the first mask is sampled by the quick check, the last only when read
def test_mask_of_the_wrong_shape(which, data, models, tmp_path, run_cli):
    broken = _break(data, tmp_path)
    victim = sorted((broken / "fg_mask" / "val" / "01_bird").iterdir())[which]
    np.save(victim, np.ones((100, 224), dtype=bool))
    _assert_one_line_error(run_cli(broken, models["color9"][1], tmp_path),
                           rf"{victim.name}.*\(100, 224\).*(224, 224)|(224, 224).*{victim.name} \(100, 224\)")


@pytest.mark.parametrize("which", [0, -1])
def test_mask_of_the_wrong_type(which, data, models, tmp_path, run_cli):
    broken = _break(data, tmp_path)
    victim = sorted((broken / "fg_mask" / "val" / "01_bird").iterdir())[which]
    np.save(victim, np.full((224, 224), "a"))
    _assert_one_line_error(run_cli(broken, models["color9"][1], tmp_path),
                           rf"{victim.name}.*dtype|dtype.*{victim.name}")


def test_no_backgrounds(data, models, tmp_path, run_cli):
    broken = _break(data, tmp_path)
    shutil.rmtree(broken / "only_bg_t")
    _assert_one_line_error(run_cli(broken, models["color9"][1], tmp_path), r"only_bg_t/val: missing")


def test_empty_background_class(data, models, tmp_path, run_cli):
    broken = _break(data, tmp_path)
    for f in (broken / "only_bg_t" / "val" / "03_reptile").iterdir():
        f.unlink()
    _assert_one_line_error(run_cli(broken, models["color9"][1], tmp_path), r"03_reptile: no images")




@pytest.mark.parametrize("decoded, asked", [("original", "binary"), ("binary", "original")])
def test_data_decoded_with_another_mask_arithmetic_is_refused(decoded, asked, data, models, tmp_path):
    """Decoded data carries its masks' arithmetic: a run asked for the other one would composite with the data's
    and key its state by it, so it is refused before anything runs."""
    from tools.data.compositing import MaskArithmetic  # noqa: PLC0415
    ready = challenge.load_challenge_data(challenge.list_challenge_files(data, 1), 1, False, MaskArithmetic(decoded))
    config = ChallengeConfig(batch_size=7, progress=False, mask_arithmetic=MaskArithmetic(asked))
    with pytest.raises(ValueError, match=f"decoded with mask arithmetic {decoded}"):
        run_challenge(load_model(trust=True, checkpoint=models["color9"][1]), CPU, ready, config, tmp_path)
