"""tools.data.image_sets: what a set holds in memory (`ImageSet.held`, the zoo's one decoding) is handed back only
for the same files, decoder and settings; anything else is decoded afresh."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import pytest
import torch

from tests.helpers import save_torchscript
from tests.test_in9_evaluate import tiny_cnn
from tools.challenge.data import list_challenge_files, load_challenge_data
from tools.data import image_sets, synthetic
from tools.data.decoders import Decoder
from tools.data.store import DecodedCache
from tools.errors import UserError
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.models.sources import load_model
from tools.runtime import Runtime
from tools.shards import Shard


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("held") / "bg_challenge", per_class=2, seed=5).root


@pytest.fixture
def decodes(monkeypatch):
    seen: list[str] = []
    real = image_sets.decode_bytes
    monkeypatch.setattr(image_sets, "decode_bytes", lambda data, name, *a, **k: seen.append(str(name)) or
                        real(data, name, *a, **k))
    return seen


def test_the_challenge_held_is_of_the_files_asked_for(data):
    """Fewer foregrounds of the same set: their own images and masks, not the whole set's held ones."""
    files = list_challenge_files(data, 1, hold=True)
    whole = load_challenge_data(files, 1, progress=False)
    fewer = dataclasses.replace(files, foregrounds=files.foregrounds[::2])
    part = load_challenge_data(fewer, 1, progress=False)
    assert part.fg_images.shape[0] == part.masks.shape[0] == len(fewer.foregrounds)
    assert torch.equal(part.fg_images, whole.fg_images[::2]) and torch.equal(part.masks, whole.masks[::2])


def test_another_decoder_decodes_the_challenge_afresh(data, decodes):
    """The set's decoder changed after a held decoding: the challenge's images (and in9's variations, below) are
    decoded again by it, not handed back from the other decoder's."""
    files = list_challenge_files(data, 1, hold=True)
    load_challenge_data(files, 1, progress=False)
    decodes.clear()
    files.image_set.decoder = _other(files.image_set.decoder)
    load_challenge_data(files, 1, progress=False)
    assert len(decodes) == len(files.foregrounds) + len(files.backgrounds)


def test_another_decoder_decodes_in9_afresh(data, decodes):
    listed = list_in9_files(data, ["original"], 1, hold=True)
    loaded = load_model(trust=True, checkpoint=_model(data))
    config = In9Config(("original",), 4, 1, progress=False)
    run_in9(loaded, Runtime(torch.device("cpu")), listed, config)
    decodes.clear()
    listed.image_set.decoder = _other(listed.image_set.decoder)
    run_in9(loaded, Runtime(torch.device("cpu")), listed, config)
    assert len(decodes) == len(listed.listings["original"])


def _model(data):
    path = data.parent / "cnn.ts"
    if not path.exists():
        save_torchscript(tiny_cnn(9, seed=2), path)
    return path


def _other(decoder: Decoder) -> Decoder:
    return Decoder.PILLOW if decoder is Decoder.TORCHVISION else Decoder.TORCHVISION


def test_a_second_run_on_a_set_decodes_no_file_unnoticed_that_changed_since_listing(tmp_path, caplog):
    """The first run frees the bytes read when listing; a second model's run on the same listing (train.py's starting
    point, without a cache) reads the files again and says which changed since their hashes were taken."""
    root = synthetic.generate(tmp_path / "bg_challenge", per_class=1, seed=6).root
    listed = list_in9_files(root, ["original"], 1)
    loaded = load_model(trust=True, checkpoint=_model(root))
    config = In9Config(("original",), 4, 1, progress=False)
    run_in9(loaded, Runtime(torch.device("cpu")), listed, config)
    first, second = (root / r.relpath for r in listed.listings["original"][:2])
    first.write_bytes(second.read_bytes())
    with caplog.at_level("WARNING", logger="tools.data.image_sets"):
        run_in9(loaded, Runtime(torch.device("cpu")), listed, config)
    assert f"{listed.listings['original'][0].relpath} changed since it was listed" in caplog.text


def test_the_challenge_decoded_again_says_which_files_changed_since_listing(tmp_path, caplog):
    """The same for the challenge's images and masks decoded a second time from one listing (no hold, no cache)."""
    root = synthetic.generate(tmp_path / "bg_challenge", per_class=1, seed=7).root
    files = list_challenge_files(root, 1)
    load_challenge_data(files, 1, progress=False)
    masks = [root / r.mask_relpath for r in files.foregrounds[:2]]
    images = [root / r.image_relpath for r in files.foregrounds[:2]]
    masks[0].write_bytes(masks[1].read_bytes())
    images[0].write_bytes(images[1].read_bytes())
    with caplog.at_level("WARNING", logger="tools.data.image_sets"):
        load_challenge_data(files, 1, progress=False)
    for changed in (files.foregrounds[0].mask_relpath, files.foregrounds[0].image_relpath):
        assert f"{changed} changed since it was listed" in caplog.text


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_file_read_again_that_became_a_fifo_is_refused_not_waited_on(tmp_path):
    """A file read again after the first run freed its bytes, replaced by a FIFO since listing: one error naming it,
    never a wait for a writer that does not come (as for a file read the first time: `hashing.open_regular`)."""
    root = synthetic.generate(tmp_path / "bg_challenge", per_class=1, seed=8).root
    listed = list_in9_files(root, ["original"], 1)
    loaded = load_model(trust=True, checkpoint=_model(root))
    config = In9Config(("original",), 4, 1, progress=False)
    run_in9(loaded, Runtime(torch.device("cpu")), listed, config)
    fifo = root / listed.listings["original"][0].relpath
    fifo.unlink()
    os.mkfifo(fifo)
    outcome: list = []

    def second_run():
        try:
            run_in9(loaded, Runtime(torch.device("cpu")), listed, config)
        except UserError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=second_run, daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():  # it waits on the FIFO: give it a writer so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(60)
        pytest.fail("the second run waited on a FIFO")
    assert outcome and "not a regular file" in str(outcome[0]) and fifo.name in str(outcome[0])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_the_cache_spot_check_of_a_second_run_does_not_wait_on_a_fifo(tmp_path):
    """A shard's second run on one listing takes its rows from the pack the first wrote; the spot check reads files
    again, and a file replaced by a FIFO is not checked (as one rewritten), never waited on."""
    root = synthetic.generate(tmp_path / "bg_challenge", per_class=1, seed=9).root
    listed = list_in9_files(root, ["original"], 1, DecodedCache(tmp_path / "cache"))
    loaded = load_model(trust=True, checkpoint=_model(root))
    config = In9Config(("original",), 4, 1, progress=False)
    first = run_in9(loaded, Runtime(torch.device("cpu")), listed, config, shard=Shard(0, 2))
    fifos = [root / r.relpath for r in listed.listings["original"]]
    for path in fifos:
        path.unlink()
        os.mkfifo(path)
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(
        run_in9(loaded, Runtime(torch.device("cpu")), listed, config, shard=Shard(0, 2))), daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():  # the spot check waits on a FIFO: give each a writer so the thread ends, then fail
        for path in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(20)
        pytest.fail("the spot check waited on a FIFO")
    assert outcome[0].results["original"].predictions.tolist() == first.results["original"].predictions.tolist()
