"""JPEG decoding: torchvision's decode_jpeg gives Pillow's pixels on every kind of JPEG, takes only the files it
may (by their bytes, not their names), is chosen only where a probe finds it bit-equal, the batches it fills
arrive in order, whatever the job size and thread count, and a run decodes the bytes it hashed."""

from __future__ import annotations

import concurrent.futures
import io
import logging
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from tools.challenge import list_challenge_files, load_challenge_data
from tools.data import decoders, image_sets, synthetic
from tools.data.decoders import Decoder, choose_decoder, plain_jpeg
from tools.data.image_sets import ImageSet, decode_rgb, iter_decoded_batches
from tools.errors import UserError
from tools.in9 import VARIATIONS
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.models.sources import load_model
from tools.runtime import Runtime

CPU = Runtime(torch.device("cpu"))


def photo(size: int = 224, seed: int = 0) -> Image.Image:
    yy, xx = np.mgrid[0:size, 0:size]
    noise = np.random.default_rng(seed).integers(0, 40, (size, size, 3))
    return Image.fromarray(np.clip(np.stack([xx, yy, (xx + yy) // 2], -1) + noise, 0, 255).astype(np.uint8))


def jpeg(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=options.pop("quality", 90), **options)
    return buffer.getvalue()


def rotated_exif() -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees
    return exif


KINDS = {
    "4:2:0": lambda: jpeg(photo(), subsampling=2),
    "4:2:2": lambda: jpeg(photo(), subsampling=1),
    "4:4:4": lambda: jpeg(photo(), subsampling=0),
    "progressive": lambda: jpeg(photo(), progressive=True),
    "optimised": lambda: jpeg(photo(), optimize=True),
    "restart markers": lambda: jpeg(photo(), restart_marker_blocks=3),
    "RGB (Adobe)": lambda: jpeg(photo(), keep_rgb=True),
    "grey": lambda: jpeg(photo().convert("L")),
    "CMYK": lambda: jpeg(photo().convert("CMYK")),
    "EXIF-rotated": lambda: jpeg(photo(), exif=rotated_exif()),
    "low quality": lambda: jpeg(photo(seed=1), quality=20),
}


def pillow_pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:  # the original's loader: convert("RGB"), no EXIF rotation
        return np.asarray(img.convert("RGB"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_both_decoders_give_pillows_pixels(kind, tmp_path):
    data = KINDS[kind]()
    path = tmp_path / "image.JPEG"
    path.write_bytes(data)
    expected = pillow_pixels(data)
    for decoder in Decoder:
        assert np.array_equal(decode_rgb(path, decoder=decoder), expected), decoder


def test_torchvision_takes_only_plain_jpegs():
    """CMYK goes to Pillow (4 components), as does anything that is not a JPEG by its bytes."""
    assert all(plain_jpeg(KINDS[kind]()) for kind in KINDS if kind != "CMYK")
    assert not plain_jpeg(KINDS["CMYK"]())
    png = io.BytesIO()
    photo().save(png, "PNG")
    assert not plain_jpeg(png.getvalue())
    assert not plain_jpeg(b"")
    assert not plain_jpeg(b"\xff\xd8\xff")


def test_png_named_jpeg_is_read_by_pillow(tmp_path, monkeypatch):
    path = tmp_path / "image.JPEG"
    photo().save(path, "PNG")
    monkeypatch.setattr(decoders, "decode_jpeg_bytes", lambda data: pytest.fail("decode_jpeg given a PNG"))
    assert np.array_equal(decode_rgb(path, decoder=Decoder.TORCHVISION), np.asarray(photo()))


def test_a_file_torchvision_refuses_goes_to_pillow(tmp_path, monkeypatch):
    path = tmp_path / "image.JPEG"
    path.write_bytes(KINDS["4:2:0"]())

    def refuse(data):
        raise RuntimeError("unsupported")

    monkeypatch.setattr(decoders, "decode_jpeg_bytes", refuse)
    assert np.array_equal(decode_rgb(path, decoder=Decoder.TORCHVISION), pillow_pixels(path.read_bytes()))


@pytest.mark.parametrize("decoder", list(Decoder))
def test_damaged_and_wrong_size_files_fail_in_one_line(decoder, tmp_path):
    damaged = tmp_path / "damaged.JPEG"
    damaged.write_bytes(KINDS["4:2:0"]()[:300])
    with pytest.raises(UserError, match="cannot read image .*damaged.JPEG"):
        decode_rgb(damaged, decoder=decoder)
    small = tmp_path / "small.JPEG"
    small.write_bytes(jpeg(photo(size=100)))
    with pytest.raises(UserError, match="small.JPEG is 100x100, expected 224x224"):
        decode_rgb(small, decoder=decoder)


def test_probe_chooses_torchvision_where_equal(tmp_path):
    files = []
    for i, kind in enumerate(KINDS):
        files.append(tmp_path / f"{i}.JPEG")
        files[-1].write_bytes(KINDS[kind]())
    assert choose_decoder(files) is Decoder.TORCHVISION
    assert choose_decoder(files, Decoder.PILLOW) is Decoder.PILLOW


def test_a_mismatch_forces_pillow(tmp_path, monkeypatch):
    """A build whose decode_jpeg gives other pixels (torchvision issue 8027) is not used."""
    path = tmp_path / "a.JPEG"
    path.write_bytes(KINDS["4:2:0"]())
    real = decoders.decode_jpeg_bytes
    monkeypatch.setattr(decoders, "decode_jpeg_bytes", lambda data: real(data).clamp(max=250))
    assert choose_decoder([path]) is Decoder.PILLOW
    assert choose_decoder([]) is Decoder.PILLOW  # the generated kinds alone show it too


def test_a_damaged_but_readable_jpeg_gives_pillows_pixels(tmp_path, capfd):
    """Bytes between the scan and its end marker: libjpeg warns (decode_jpeg prints "Corrupt JPEG data" to
    stderr, Pillow nothing) and both decoders give the same pixels."""
    data = KINDS["4:2:0"]()
    path = tmp_path / "damaged.JPEG"
    path.write_bytes(data[:-2] + b"\x00\x01\x02" + data[-2:])
    expected = pillow_pixels(path.read_bytes())
    for decoder in Decoder:
        assert np.array_equal(decode_rgb(path, decoder=decoder), expected), decoder
    capfd.readouterr()  # the warning: expected, not shown


def test_a_torchvision_that_cannot_decode_at_all_means_pillow(tmp_path, monkeypatch, caplog):
    """A torchvision whose image extension failed to load raises AttributeError (not RuntimeError) from
    decode_jpeg: the probe chooses Pillow, in one log line, rather than stopping the listing."""
    path = tmp_path / "a.JPEG"
    path.write_bytes(KINDS["4:2:0"]())

    def broken(data):
        raise AttributeError("'_OpNamespace' 'image' object has no attribute 'decode_jpeg'")

    monkeypatch.setattr(decoders, "decode_jpeg_bytes", broken)
    with caplog.at_level(logging.INFO, logger=decoders.__name__):
        assert choose_decoder([path]) is Decoder.PILLOW
    assert "AttributeError" in caplog.text


def test_torchvisions_deprecation_warning_is_no_error(tmp_path):
    """Under `python -W error::DeprecationWarning` torchvision 0.29's deprecation warning for decode_jpeg neither
    turns the probe to Pillow nor fails a decode in a decoding thread."""
    path = tmp_path / "a.JPEG"
    path.write_bytes(KINDS["4:2:0"]())
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert choose_decoder([path]) is Decoder.TORCHVISION
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pixels = list(pool.map(lambda _: decoders.decode_jpeg_bytes(path.read_bytes()), range(4)))
    assert all(torch.equal(p, pixels[0]) for p in pixels)


def test_the_deprecation_filter_dropped_between_its_check_and_the_call_is_no_error(tmp_path, monkeypatch):
    """A `warnings.catch_warnings` that another thread leaves (a model load, beside the decoding threads) puts back
    the filters it saved: when that happens after a decoding thread found the filter in place and before its
    decode_jpeg call warns, the call is still no error under `-W error::DeprecationWarning`."""
    import torchvision.io  # noqa: PLC0415
    data = KINDS["4:2:0"]()
    real, calls = torchvision.io.decode_jpeg, []

    def dropped_first(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the other thread's catch_warnings leaves now
            warnings.filters[:] = [f for f in warnings.filters if f not in decoders._silenced]
        return real(*args, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        expected = decoders.decode_jpeg_bytes(data)
        monkeypatch.setattr(torchvision.io, "decode_jpeg", dropped_first)
        assert torch.equal(decoders.decode_jpeg_bytes(data), expected)


def sof_patched(data: bytes, offset: int, value: int) -> bytes:
    """`data` with the byte at `offset` from its (first) start-of-frame marker replaced by `value`."""
    pos = data.index(b"\xff\xc0")
    return data[:pos + offset] + bytes([value]) + data[pos + offset + 1:]


def test_torchvision_takes_only_the_precision_and_samplings_the_probe_tried():
    """12-bit samples, 4:1:1 or 4:4:0 chroma, extended frames: Pillow's (the probe generates none of them)."""
    baseline = KINDS["4:2:0"]()
    assert plain_jpeg(baseline)
    assert sof_patched(baseline, 4, 8) == baseline and sof_patched(baseline, 11, 0x22) == baseline  # the offsets
    assert not plain_jpeg(sof_patched(baseline, 4, 12))  # precision
    assert not plain_jpeg(sof_patched(baseline, 11, 0x41))  # 4:1:1
    assert not plain_jpeg(sof_patched(baseline, 11, 0x12))  # 4:4:0
    assert not plain_jpeg(sof_patched(baseline, 14, 0x21))  # chroma sampled finer than luma
    assert not plain_jpeg(sof_patched(baseline, 1, 0xC1))  # extended sequential
    assert not plain_jpeg(sof_patched(KINDS["grey"](), 11, 0x22))  # one component, sampled 2x2
    assert not plain_jpeg(baseline[:baseline.index(b"\xff\xc0") + 12])  # cut inside the frame header


def test_the_probe_tries_every_kind_plain_jpeg_takes():
    """One generated sample of each: 4:4:4, 4:2:2, 4:2:0 and grey, baseline and progressive."""
    kinds = set()
    for data in decoders._probe_samples():
        assert plain_jpeg(data)
        frame = data.index(b"\xff\xc0") if b"\xff\xc0" in data else data.index(b"\xff\xc2")
        components = data[frame + 9]
        kinds.add((data[frame + 1], components, data[frame + 11]))
    assert kinds == {(frame, 3, sampling) for frame in (0xC0, 0xC2) for sampling in (0x11, 0x21, 0x22)} | \
        {(0xC0, 1, 0x11), (0xC2, 1, 0x11)}


@pytest.mark.parametrize("batch_size,workers", [(5, 1), (40, 2), (100, 3)])
def test_batches_come_in_order_with_every_image(batch_size, workers, dataset, monkeypatch):
    """Jobs smaller than a batch (and batches smaller than a job) fill each batch in order."""
    monkeypatch.setattr(image_sets, "JOB_IMAGES", 3)
    relpaths = sorted(str(p.relative_to(dataset.root)) for p in (dataset.root / "original").rglob("*.JPEG"))
    expected = np.stack([decode_rgb(dataset.root / rel) for rel in relpaths])
    seen = 0
    for start, batch in iter_decoded_batches(ImageSet(dataset.root, decoder=Decoder.TORCHVISION), relpaths,
                                             batch_size, workers, device=torch.device("cpu")):
        assert start == seen and batch.shape[1] == 3 and batch.is_contiguous(memory_format=torch.channels_last)
        assert np.array_equal(batch.permute(0, 2, 3, 1).numpy(), expected[start:start + batch.shape[0]])
        seen += batch.shape[0]
    assert seen == len(relpaths)


@pytest.fixture
def small_data(tmp_path):
    return synthetic.generate(tmp_path / "bg_challenge", per_class=1, seed=2).root


def spoil_every_file(root) -> None:
    for path in root.rglob("*"):
        if path.suffix in (".JPEG", ".npy"):
            path.write_bytes(b"spoiled after it was hashed")


def test_in9_decodes_the_bytes_it_hashed(small_data, color_ts):
    """Each file is read once, when hashed: rewriting them all after listing changes nothing in the run."""
    loaded = load_model(checkpoint=color_ts[9], trust=True)
    config = In9Config(batch_size=7, workers=2, progress=False)
    expected = run_in9(loaded, CPU, list_in9_files(small_data, VARIATIONS, 2), config)
    files = list_in9_files(small_data, VARIATIONS, 2)
    spoil_every_file(small_data)
    run = run_in9(loaded, CPU, files, config)
    assert {n: r.predictions.tolist() for n, r in run.results.items()} == \
        {n: r.predictions.tolist() for n, r in expected.results.items()}
    assert run.provenance["data"] == expected.provenance["data"] and not files.image_set.contents  # the bytes let go


def test_the_challenge_decodes_the_bytes_it_hashed(small_data):
    expected = load_challenge_data(list_challenge_files(small_data, 2), 2, progress=False)
    files = list_challenge_files(small_data, 2)
    spoil_every_file(small_data)
    data = load_challenge_data(files, 2, progress=False)
    for name in ("fg_images", "masks", "bg_images"):
        assert torch.equal(getattr(data, name), getattr(expected, name)), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batches_copied_on_the_side_stream_arrive_whole(dataset):
    """On CUDA the batches come on the device through the copy stream, pinned, each equal to its decoded pixels
    even while the consumer's stream is busy (a copy the consumer did not wait for would show stale bytes)."""
    relpaths = sorted(str(p.relative_to(dataset.root)) for p in dataset.root.rglob("*.JPEG"))
    expected = np.stack([decode_rgb(dataset.root / rel) for rel in relpaths])
    device = torch.device("cuda")
    busy = torch.randn(2048, 2048, device=device)
    for start, batch in iter_decoded_batches(ImageSet(dataset.root, decoder=Decoder.TORCHVISION), relpaths, 16, 2,
                                             pin_memory=True, device=device):
        busy = busy @ busy / 2048  # keep the consumer's stream working
        assert batch.device.type == "cuda"
        seen = batch.permute(0, 2, 3, 1).cpu().numpy()
        assert np.array_equal(seen, expected[start:start + batch.shape[0]])
