"""in9_eval and challenge_eval list, hash and decode their data in the background while the model is built (after
the fast checks of the folders); an error found only while decoding is still one `error:` line, exit 2, with no
thread left running."""

from __future__ import annotations

import json
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import challenge_eval
import in9_eval
import tools.challenge.data
import tools.data.decoders
import tools.data.hashing
import tools.data.image_sets
import tools.in9.evaluate
from tests.helpers import check_error, run_in_process, save_torchscript
from tools import options
from tools.cli import Terminated
from tools.models.architectures import SmallCNN

WAIT_S = 20  # a run that does not overlap waits this long, then fails


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "model.pt"
    save_torchscript(SmallCNN(9), path)
    return path


def command(script: str, root, checkpoint, tmp_path) -> tuple:
    main, extra = (in9_eval.main, ["--eval-dataset", "original"]) if script == "in9" else (challenge_eval.main, [])
    return main, ["--data-path", str(root), "--checkpoint", str(checkpoint), "--trust-checkpoint", "--device", "cpu",
                  "--no-progress",
                  "--batch-size", "16", "--workers", "1", "--output-dir", str(tmp_path / "out"),
                  "--log-level", "WARNING", *extra]


@pytest.mark.parametrize("script", ["in9", "challenge"])
@pytest.mark.slow
def test_the_data_is_hashed_while_the_model_is_built(script, dataset, checkpoint, tmp_path, monkeypatch, capsys,
                                                     one_thread):
    """Hashing the files waits until the model's building has started (it never starts, in a run that builds the
    model after the data): the run finishes, and the data work saw the model being built."""
    building, events = threading.Event(), []
    build, hashing = options.model_from_args, tools.data.image_sets.read_and_fingerprint

    def model_from_args(*args, **kwargs):
        events.append("model: start")
        building.set()
        built = build(*args, **kwargs)
        events.append("model: built")
        return built

    def read_and_fingerprint(*args, **kwargs):
        events.append("data: hashing")
        events.append("data: the model is being built" if building.wait(WAIT_S) else "data: no model in sight")
        return hashing(*args, **kwargs)

    monkeypatch.setattr(options, "model_from_args", model_from_args)
    monkeypatch.setattr(tools.data.image_sets, "read_and_fingerprint", read_and_fingerprint)
    main, argv = command(script, dataset.root, checkpoint, tmp_path)
    code, out, err = run_in_process(main, argv, capsys)
    assert code == 0, err
    assert "data: the model is being built" in events, events


@pytest.mark.parametrize("script", ["in9", "challenge"])
@pytest.mark.parametrize("model_fails", [False, True])
@pytest.mark.slow
def test_a_file_found_damaged_while_decoding_is_one_error_line(script, model_fails, dataset, checkpoint, tmp_path,
                                                               monkeypatch, capsys, one_thread):
    """A later background (in9: a later image of original) that is not a JPEG passes the fast checks and fails as
    it is decoded, in the background: one line naming it, exit 2, whether the model was built or failed meanwhile,
    and no thread of the run still alive."""
    root = Path(shutil.copytree(dataset.root, tmp_path / "bg_challenge"))  # a copy to break
    folder = "only_bg_t" if script == "challenge" else "original"
    path = sorted((root / folder / "val").glob("*/*"))[-1]
    path.write_bytes(b"this is not a JPEG")
    if model_fails:
        checkpoint.write_bytes(b"not a checkpoint")
    before = set(threading.enumerate())
    main, argv = command(script, root, checkpoint, tmp_path)
    code, out, err = run_in_process(main, argv, capsys)
    line = check_error(code, out, err, lines=None)
    # in9 decodes its images as it predicts: a model that fails is found first, as before
    assert ("checkpoint" if script == "in9" and model_fails else path.name) in line, line
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]


def test_the_data_side_finds_its_imports_made_before_it_starts(monkeypatch):
    """What the data side imports on its way (torchvision.io for decoding) is imported before its thread starts:
    two threads importing torch's modules at once broke a torch.export load (KeyError 'torch._dynamo')."""
    import sys  # noqa: PLC0415

    from tools.threads import alongside  # noqa: PLC0415
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    seen, _ = alongside(lambda: "colorsys" in sys.modules, lambda: None, imports=["colorsys"])
    assert seen


@pytest.mark.parametrize("script", ["in9", "challenge"])
@pytest.mark.slow
def test_both_commands_import_the_decoders_before_the_data_thread(script, dataset, checkpoint, tmp_path, monkeypatch,
                                                                   capsys, one_thread):
    from tools import prepared_run, threads  # noqa: PLC0415
    from tools.data import decoders  # noqa: PLC0415
    asked = []

    def alongside(data, model, imports=()):
        asked.append(tuple(imports))
        return threads.alongside(data, model, imports)

    monkeypatch.setattr(prepared_run, "alongside", alongside)
    main, argv = command(script, dataset.root, checkpoint, tmp_path)
    code, _, err = run_in_process(main, argv, capsys)
    assert code == 0, err
    assert asked == [decoders.LAZY_IMPORTS] and "torchvision.io" in decoders.LAZY_IMPORTS


@pytest.mark.parametrize("script", ["in9", "challenge"])
@pytest.mark.parametrize("interrupt, code", [(KeyboardInterrupt, 130), (Terminated, 143)])
@pytest.mark.slow
def test_an_interrupt_while_the_model_is_built_stops_the_data_work(script, interrupt, code, dataset, checkpoint,
                                                                   tmp_path, monkeypatch, capsys, one_thread):
    """Ctrl-C (or SIGTERM) while the model is built and the data is hashed, file by file: the run ends with 130
    (143), not an error, having hashed only the files it had started on (a run that waits for the data work to
    finish hashes them all), and no thread of the run is left."""
    hashing, hashed, started = tools.data.hashing._hash_and_keep, [], threading.Event()

    def hash_slowly(path, *args):
        hashed.append(path)
        started.set()
        time.sleep(0.05)
        return hashing(path, *args)

    def model_from_args(*args, **kwargs):
        assert started.wait(WAIT_S)
        raise interrupt()

    monkeypatch.setattr(tools.data.hashing, "_hash_and_keep", hash_slowly)
    monkeypatch.setattr(options, "model_from_args", model_from_args)
    before = set(threading.enumerate())
    main, argv = command(script, dataset.root, checkpoint, tmp_path)
    got, out, err = run_in_process(main, argv, capsys)
    assert got == code, err
    assert "error:" not in err, err
    assert len(hashed) <= 4, f"{len(hashed)} files hashed after the interrupt"
    assert not [t for t in threading.enumerate() if t not in before and t.is_alive() and not t.daemon]


def test_the_decoders_warning_filter_outlives_a_model_load_that_restores_the_filters(dataset, checkpoint, tmp_path,
                                                                                      monkeypatch, capsys, one_thread):
    """Under `-W error::DeprecationWarning`: the decoder's probe (in the data thread) silences torchvision's
    deprecation of decode_jpeg while the main thread loads the TorchScript checkpoint inside
    `warnings.catch_warnings`, which puts back the filters it saved as it leaves. The images still decode with
    torchvision, with no warning turned error."""
    probed, choose, load = threading.Event(), tools.data.decoders.choose_decoder, torch.jit.load

    def choose_and_say(*args, **kwargs):
        chosen = choose(*args, **kwargs)
        probed.set()
        return chosen

    def load_after_the_probe(*args, **kwargs):
        assert probed.wait(WAIT_S)
        return load(*args, **kwargs)

    monkeypatch.setattr(tools.data.decoders, "choose_decoder", choose_and_say)
    monkeypatch.setattr(torch.jit, "load", load_after_the_probe)
    main, argv = command("in9", dataset.root, checkpoint, tmp_path)
    argv += ["--results-file", str(tmp_path / "in9.json")]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        code, out, err = run_in_process(main, argv, capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "in9.json").read_text())["provenance"]["decoder"]["used"] == "torchvision"


@pytest.mark.parametrize("interrupt, code", [(KeyboardInterrupt, 130), (Terminated, 143)])
def test_an_interrupt_while_the_data_thread_writes_a_cache_pack_leaves_no_part_of_it(interrupt, code, dataset,
                                                                                   checkpoint, tmp_path, monkeypatch,
                                                                                   capsys, one_thread):
    """The challenge's data thread decodes its images into a cache pack's temporary folder while the model is
    built; an interrupt then ends the run with 130 (143), its pack neither kept nor left half written."""
    decode, started = tools.data.image_sets.decode_bytes, threading.Event()
    cache = tmp_path / "cache"

    def decode_slowly(*args, **kwargs):
        if any(p.name.startswith(".tmp-") for p in cache.iterdir()):
            started.set()  # a pack is being written
        time.sleep(0.02)
        return decode(*args, **kwargs)

    def model_from_args(*args, **kwargs):
        assert started.wait(WAIT_S)
        raise interrupt()

    monkeypatch.setattr(tools.data.image_sets, "decode_bytes", decode_slowly)
    monkeypatch.setattr(options, "model_from_args", model_from_args)
    main, argv = command("challenge", dataset.root, checkpoint, tmp_path)
    got, _, err = run_in_process(main, [*argv, "--cache-dir", str(cache)], capsys)
    assert got == code, err
    assert "error:" not in err, err
    assert not [p.name for p in cache.iterdir() if p.name.startswith((".tmp-", "image-"))]
