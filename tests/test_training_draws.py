"""An epoch's random choices (backgrounds, crops, flips) drawn at once, and batches gathered from the decoded
store at once: against per-sample brute-force references written as the earlier per-sample code drew and
composed them (torchvision's RandomResizedCrop.get_params loop, the class-then-pool background pick, compositing
and cropping one image at a time), on the same uniform numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tools.data.compositing import byte_masks, composite
from tools.in9 import IMAGE_SIZE, NUM_IN9_CLASSES
from tools.training import draws as draws_module
from tools.training.config import Method, TrainConfig
from tools.training.draws import CROP_TRIES, EpochDraws, epoch_uniforms


def reference_box(scale_u, ratio_u, top_u, left_u, scale_min, size=IMAGE_SIZE):
    """torchvision's RandomResizedCrop.get_params, one image, its uniforms given instead of drawn."""
    area = size * size
    low, high = math.log(3 / 4), math.log(4 / 3)
    for attempt in range(CROP_TRIES):
        target_area = area * (scale_min + (1.0 - scale_min) * scale_u[attempt])
        aspect_ratio = math.exp(low + (high - low) * ratio_u[attempt])
        width = int(round(math.sqrt(target_area * aspect_ratio)))
        height = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < width <= size and 0 < height <= size:
            return (int(top_u * (size - height + 1)), int(left_u * (size - width + 1)), height, width)
    return 0, 0, size, size


def reference_background(row, label, swap_prob, same_prob, pool_by_class):
    """The earlier TrainingSet._background: swap or not, own class or a random one, then a pool member."""
    swap = row[0] < swap_prob
    klass = label if row[1] < same_prob else int(row[2] * NUM_IN9_CLASSES)
    pool = pool_by_class[klass]
    return bool(swap), int(pool[int(row[3] * len(pool))])


@pytest.mark.parametrize("scale_min, swap_prob, same_prob", [(0.35, 1.0, 0.0), (0.08, 0.6, 0.3), (0.9, 0.0, 1.0)])
def test_epoch_draws_equal_the_per_sample_reference(scale_min, swap_prob, same_prob):
    labels = np.arange(500) % NUM_IN9_CLASSES
    background_labels = np.repeat(np.arange(NUM_IN9_CLASSES), [3, 1, 4, 2, 5, 1, 2, 3, 7])
    pool_by_class = [np.flatnonzero(background_labels == k) for k in range(NUM_IN9_CLASSES)]
    u = epoch_uniforms(seed=4, epoch=2, size=len(labels))
    got = EpochDraws.from_uniforms(u, torch.as_tensor(labels), torch.as_tensor(background_labels), scale_min,
                                   swap_prob, same_prob)
    s = draws_module.SLOTS
    for i, row in enumerate(u.tolist()):
        assert tuple(got.boxes[i].tolist()) == reference_box(row[s.scale], row[s.ratio], row[s.top], row[s.left],
                                                              scale_min)
        assert bool(got.flips[i]) == (row[s.flip] < 0.5)
        swap, background = reference_background(row[s.swap:s.swap + 4], int(labels[i]), swap_prob, same_prob,
                                                pool_by_class)
        assert bool(got.swaps[i]) == swap and int(got.backgrounds[i]) == background
    # the distributions torchvision's get_params gives: areas and aspects within range, a few fallbacks at most
    heights, widths = got.boxes[:, 2].double(), got.boxes[:, 3].double()
    share = heights * widths / IMAGE_SIZE**2
    assert share.min() >= scale_min - 0.02 and (widths / heights).min() > 0.7 and (widths / heights).max() < 1.45
    assert abs(got.swaps.double().mean() - swap_prob) < 0.1


def test_epoch_draws_depend_on_seed_and_epoch_only():
    a, b = epoch_uniforms(1, 0, 50), epoch_uniforms(1, 0, 50)
    assert torch.equal(a, b) and a.dtype == torch.float64
    assert not torch.equal(a, epoch_uniforms(1, 1, 50)) and not torch.equal(a, epoch_uniforms(2, 0, 50))


def test_an_epoch_of_batches_seeds_no_generator_per_sample(tiny, monkeypatch, one_thread):
    """Gathering an epoch's batches derives a seed and builds a generator once per epoch, never per sample."""
    from tools.data.hashing import fingerprint  # noqa: PLC0415
    from tools.training import data as data_module  # noqa: PLC0415
    from tools.training.data import StepSampler, decoded_store, list_training_data, make_loader  # noqa: PLC0415
    config = TrainConfig(data_path=tiny, output_dir=tiny.parent / "unused", methods=[Method.BG_SWAP], batch_size=4,
                         seed=3, workers=0, progress=False)
    data = list_training_data(config)
    store = decoded_store(data, fingerprint(data.root, data.relpaths(), 1), 1, False)
    calls = []
    real = draws_module.derived_seed
    monkeypatch.setattr(draws_module, "derived_seed", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(data_module, "derived_seed", lambda *a: calls.append(a) or real(*a))
    monkeypatch.setattr(np.random, "default_rng", lambda *a: pytest.fail("a numpy generator per sample"))
    batches = list(make_loader(data, config, StepSampler(len(data), 4, 3, 0, end_epoch=2), False, store))
    assert len(batches) == 2 * (len(data) // 4)
    assert len([c for c in calls if "draws" in c]) == 2  # one table per epoch


@pytest.mark.parametrize("swap_prob", [0.5, 1.0])
def test_a_gathered_batch_equals_the_per_sample_swap_crop_and_flip(swap_prob, tiny, one_thread):
    """The batch gathered from the store and finished by device_batch equals a loop that composites, crops and
    flips one image at a time from the same epoch draws, in torchvision's layout: the crop is torch's uint8
    antialiased resize of the box, what torchvision's resized_crop runs where it keeps uint8 (it may compute in
    float32 instead, as 0.21 does on CPUs without "AVX2" in torch's capability name: then within one level)."""
    from torchvision.transforms.v2 import functional as F  # noqa: PLC0415

    from tools.data.hashing import fingerprint  # noqa: PLC0415
    from tools.training.data import StepSampler, decoded_store, device_batch, list_training_data, make_loader  # noqa: PLC0415
    config = TrainConfig(data_path=tiny, output_dir=tiny.parent / "unused", methods=[Method.BG_SWAP], batch_size=6,
                         seed=5, workers=0, progress=False, swap_prob=swap_prob)
    data = list_training_data(config)
    store = decoded_store(data, fingerprint(data.root, data.relpaths(), 1), 1, False)
    sampler = StepSampler(len(data), 6, 5, 1)
    u = epoch_uniforms(5, 1, len(data))
    d = EpochDraws.from_uniforms(u, torch.as_tensor(data.labels), torch.as_tensor(data.background_labels),
                                 config.crop_scale, config.swap_prob, config.swap_same_class_prob)
    assert 0 < int(d.swaps.sum()) < len(data) if swap_prob < 1 else bool(d.swaps.all())
    assert 0 < int(d.flips.sum()) < len(data)
    for items, batch in zip(sampler, make_loader(data, config, sampler, False, store)):
        images, labels = device_batch(batch, torch.device("cpu"), True)
        for k, (_, i) in enumerate(items):
            image = store.images[i].contiguous()  # the reference in torchvision's own layout (the store: NHWC)
            if d.swaps[i]:
                image = composite(image[None], store.backgrounds[d.backgrounds[i]][None],
                                  byte_masks(store.masks[i][None]))[0]
            top, left, height, width = d.boxes[i].tolist()
            expected = torch.nn.functional.interpolate(image[None, :, top:top + height, left:left + width],
                                                       size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear",
                                                       antialias=True)[0]
            torchvisions = F.resized_crop(image, top, left, height, width, [IMAGE_SIZE, IMAGE_SIZE], antialias=True)
            if d.flips[i]:
                expected, torchvisions = expected.flip(-1), torchvisions.flip(-1)
            assert torch.equal(images[k], expected) and int(labels[k]) == data.labels[i]
            assert (images[k].int() - torchvisions.int()).abs().max() <= 1


def test_channels_last_byte_masks_composite_the_same_bytes():
    """The byte masks for channels-last images (three bytes a pixel) composite exactly the one-channel ones."""
    gen = torch.Generator().manual_seed(0)
    fg, bg = (torch.randint(0, 256, (3, 3, 20, 30), dtype=torch.uint8, generator=gen) for _ in range(2))
    masks = torch.rand(3, 20, 30, generator=gen) > 0.5
    expected = composite(fg.clone(), bg.clone(), byte_masks(masks))
    last = torch.channels_last
    got = composite(fg.contiguous(memory_format=last), bg.contiguous(memory_format=last),
                    byte_masks(masks, channels_last=True))
    assert byte_masks(masks, channels_last=True).is_contiguous(memory_format=last)
    assert torch.equal(got, expected)


def test_a_worker_gathers_its_batch_straight_into_shared_memory(tiny, monkeypatch, one_thread):
    """In a DataLoader worker the batch is gathered into shared memory, so the worker's queue passes it on without
    copying it again; its contents and the store's layout are those of the training process's own gather."""
    from tools.data.hashing import fingerprint  # noqa: PLC0415
    from tools.training import data as data_module  # noqa: PLC0415
    from tools.training.data import TrainingSet, decoded_store, list_training_data  # noqa: PLC0415
    config = TrainConfig(data_path=tiny, output_dir=tiny.parent / "unused", methods=[Method.BG_SWAP], batch_size=4,
                         seed=3, workers=1, progress=False)
    data = list_training_data(config)
    store = decoded_store(data, fingerprint(data.root, data.relpaths(), 1), 1, False)
    assert store.images.is_contiguous(memory_format=torch.channels_last)
    items = [(0, i) for i in (5, 0, 3, 3)]
    here = TrainingSet(data, config, store).__getitems__(items)
    monkeypatch.setattr(data_module, "get_worker_info", lambda: object())
    there = TrainingSet(data, config, store).__getitems__(items)
    for key in ("image", "mask", "background"):
        assert there[key].is_shared() and not here[key].is_shared()
        assert torch.equal(there[key], here[key]) and there[key].stride() == here[key].stride()
    assert torch.equal(here["image"], store.images[[5, 0, 3, 3]])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_batch_copied_on_the_side_stream_is_the_cpu_batch_within_one_level(tiny, one_thread):
    from tools.data.hashing import fingerprint  # noqa: PLC0415
    from tools.training.data import StepSampler, decoded_store, device_batch, list_training_data, make_loader  # noqa: PLC0415
    config = TrainConfig(data_path=tiny, output_dir=tiny.parent / "unused", methods=[Method.BG_SWAP], batch_size=6,
                         seed=5, workers=0, progress=False)
    data = list_training_data(config)
    store = decoded_store(data, fingerprint(data.root, data.relpaths(), 1), 1, False)
    for batch in make_loader(data, config, StepSampler(len(data), 6, 5, 0), True, store):
        cpu_copy = {key: value.clone() if torch.is_tensor(value) else value for key, value in batch.items()}
        on_gpu, labels = device_batch(batch, torch.device("cuda"), True)  # composites in place, maybe still copying
        on_cpu, cpu_labels = device_batch(cpu_copy, torch.device("cpu"), True)
        assert torch.equal(labels.cpu(), cpu_labels)
        assert (on_gpu.cpu().int() - on_cpu.int()).abs().max() <= 1


def test_a_cpu_run_seeds_the_cpu_generator_alone_at_each_step(tiny, tmp_path, capsys, monkeypatch, one_thread):
    """torch.manual_seed also queues a seed for every accelerator runtime with a stack trace (about 1 ms a call,
    twice a step): on a CPU device the steps seed the CPU generator alone, and the run equals one seeded by
    torch.manual_seed at every step."""
    from tests.helpers import TINY, run_train, weights  # noqa: PLC0415
    from tools.training import loop  # noqa: PLC0415
    from tools.training.checkpoint import CHECKPOINT_NAME  # noqa: PLC0415
    common = ["--data-path", tiny, "--weights", "none", "--method", "bg-swap", "mixup", "--batch-size", 6, *TINY]
    calls = []
    real = torch.cuda.manual_seed_all
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed) or real(seed))
    code, _, err = run_train([*common, "--output-dir", tmp_path / "cpu"], capsys)
    assert code == 0, err
    assert len(calls) == 1  # the model's initialisation, once
    monkeypatch.setattr(loop, "seed_generators", lambda device, seed: torch.manual_seed(seed))
    code, _, err = run_train([*common, "--output-dir", tmp_path / "all"], capsys)
    assert code == 0, err
    assert len(calls) > 3
    a, b = weights(tmp_path / "cpu" / CHECKPOINT_NAME), weights(tmp_path / "all" / CHECKPOINT_NAME)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_batches_reach_a_device_other_than_the_cpu_and_cuda_contiguous():
    """The store's channels-last layout stays on the CPU and CUDA: on another device (MPS) the batch arrives
    contiguous, since torch 2.6-2.7's MPS bitwise kernels mis-order channels-last operands (pytorch#145203)."""
    from tools.training.data import _mover  # noqa: PLC0415
    batch = torch.zeros(2, 224, 224, 3, dtype=torch.uint8).permute(0, 3, 1, 2)
    assert _mover(torch.device("meta"))(batch).is_contiguous()
    assert not _mover(torch.device("cpu"))(batch).is_contiguous()  # the CPU keeps the fast layout
