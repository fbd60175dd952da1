"""Batch shapes: in every mode the model sees one batch size (the chunk) whatever the tails and re-checked
subsets, so a row's logits do not depend on how rows were grouped; the padding never changes a kept row; the zoo
compiles each model afresh, one graph each."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torchvision

from tools import zoo
from tools.challenge import ChallengeConfig, list_challenge_files, run_challenge
from tools.data import synthetic
from tools.in9 import IN9_MEAN, IN9_STD, VARIATIONS
from tools.in9.evaluate import evaluate_variations, list_in9_files
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.models.boundary import LoadedModel, PixelModel
from tools.runtime import Forward, Precision, Runtime
from tools.shards import Shard

BATCH = 25  # not a power of two, and no divisor of the data's counts: every kind of tail occurs


class RecordsBatchSizes(torch.nn.Module):
    """The hand-built colour model, recording the batch size of every call."""

    def __init__(self):
        super().__init__()
        self.classifier = synthetic.ColorEvidenceModel(9)
        self.sizes: list[int] = []

    def forward(self, x):
        self.sizes.append(x.shape[0])
        return self.classifier(x)


def recording_model() -> tuple[LoadedModel, RecordsBatchSizes]:
    recorder = RecordsBatchSizes()
    return LoadedModel(PixelModel(recorder, IN9_MEAN, IN9_STD), 9, None, None, None, None, "test", "test"), recorder


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("shard", [None, Shard(1, 2)])  # share 1 of 2 holds the tail
@pytest.mark.slow
def test_the_in9_evaluation_runs_one_batch_shape(dataset, shard, precision, one_thread):
    loaded, recorder = recording_model()
    evaluate_variations(loaded, Runtime(torch.device("cpu"), precision), list_in9_files(dataset.root, VARIATIONS, 1),
                        BATCH, 1, progress=False, shard=shard, recheck_margin=0.5)
    assert set(recorder.sizes) == {BATCH}


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.slow
def test_the_challenge_runs_one_batch_shape_with_its_rechecks(dataset, full, precision, one_thread):
    loaded, recorder = recording_model()
    config = ChallengeConfig(batch_size=BATCH, progress=False, full=full, recheck_margin=0.5)
    result = run_challenge(loaded, Runtime(torch.device("cpu"), precision), list_challenge_files(dataset.root, 1),
                           config, workers=1)
    if precision is Precision.BF16:
        assert 0 < result.rechecked < result.state.evaluated  # subsets of batches were re-checked
    assert set(recorder.sizes) == {BATCH}


def test_the_same_rows_grouped_into_other_batches_give_bit_equal_logits(one_thread):
    """fp32 on the CPU, where this model's convolutions and linear layer give other last bits at other batch
    sizes: the same images run whole, in pieces of other sizes, from other positions, or as a tail, give the
    same logits bit for bit (the exact mode pads every piece to the one batch size)."""
    torch.manual_seed(0)
    model = PixelModel(SmallCNN(9), IN9_MEAN, IN9_STD).eval()
    images = torch.randint(0, 256, (2 * BATCH + 3, 3, 64, 64), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(2))
    forward = Forward(model, Runtime(torch.device("cpu")), BATCH)
    whole = forward(images)
    with torch.inference_mode():  # the model really differs by batch size here: the test can fail
        assert not torch.equal(model(images[:7]), model(images[:BATCH])[:7])
    for cuts in ([7], [1, 2, 30], [BATCH - 1, BATCH + 1], [3, BATCH, 9]):
        bounds = [0, *torch.tensor(cuts).cumsum(0).tolist(), len(images)]
        grouped = torch.cat([forward(images[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo])
        assert torch.equal(grouped, whole), cuts


def tiny_resnet() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=9)
    with torch.no_grad():  # BatchNorm statistics other than the initial ones, so that eval mode really uses them
        for module in net.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    return net


@pytest.mark.parametrize("classifier", [lambda: SmallCNN(9), lambda: synthetic.ColorEvidenceModel(9, trunk_width=8),
                                        tiny_resnet], ids=["small_cnn", "color_trunk", "resnet18"])
@pytest.mark.slow
def test_padding_never_changes_a_kept_row(classifier, one_thread):
    """In fp32 on the CPU, each row kept from a padded batch equals, bit for bit, that row run in a batch of the
    same size whose other rows are other images: the copies added never reach the rows kept. (Not always the same
    row run in a smaller batch: the CPU's 1x1 convolution gives other last bits at other batch sizes, which is why
    every mode runs one batch size.)"""
    recorder = RecordsBatchSizes()
    recorder.classifier = classifier()
    model = PixelModel(recorder, IN9_MEAN, IN9_STD).eval()
    images = torch.randint(0, 256, (2 * BATCH, 3, 64, 64), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(1))
    forward = Forward(model, Runtime(torch.device("cpu")), BATCH)
    for rows in (1, 3, 5, 6, 7, 12, 17, BATCH, BATCH + 7):
        recorder.sizes.clear()
        padded = forward(images[:rows])
        sizes = list(recorder.sizes)
        starts = range(0, rows, BATCH)
        assert len(sizes) == len(starts) and set(sizes) == {BATCH}
        assert rows % BATCH == 0 or sum(sizes) > rows  # rows were really added
        with torch.inference_mode():
            others = torch.cat([model(images[start:start + size])[:min(BATCH, rows - start)]
                                for start, size in zip(starts, sizes)])
        assert padded.shape == others.shape and torch.equal(padded, others), rows


@pytest.mark.slow
def test_the_static_buffer_gives_the_exact_runs_predictions(dataset, monkeypatch, one_thread):
    """fp32 through --compile's static batch buffer (torch.compile left out): the same predictions on every
    variation and the same full challenge matrix as the exact mode's own padding."""
    monkeypatch.setattr(torch, "compile", lambda model, **options: model)
    runs = []
    for runtime in (Runtime(torch.device("cpu")), Runtime(torch.device("cpu"), compile=True)):
        torch.manual_seed(0)
        loaded = LoadedModel(PixelModel(SmallCNN(9), IN9_MEAN, IN9_STD), 9, None, None, None, None, "test", "test")
        in9, _ = evaluate_variations(loaded, runtime, list_in9_files(dataset.root, VARIATIONS, 1), BATCH, 1,
                                     progress=False)
        config = ChallengeConfig(batch_size=BATCH, progress=False, full=True)
        full = run_challenge(loaded, runtime, list_challenge_files(dataset.root, 1), config, workers=1)
        runs.append(([in9[name].predictions.tolist() for name in VARIATIONS], full.state.matrix.tolist()))
    assert runs[0] == runs[1]


def test_exact_mode_pads_a_tail_to_the_batch_size_and_pad_false_does_not(one_thread):
    recorder = RecordsBatchSizes()
    model = PixelModel(recorder, IN9_MEAN, IN9_STD).eval()
    Forward(model, Runtime(torch.device("cpu")), BATCH)(torch.zeros(7, 3, 32, 32, dtype=torch.uint8))
    Forward(model, Runtime(torch.device("cpu")), BATCH, pad=False)(torch.zeros(7, 3, 32, 32, dtype=torch.uint8))
    assert recorder.sizes == [BATCH, 7]


def test_a_speed_mode_pads_batches_of_any_rank_and_formats_only_images(one_thread):
    """Padding works on what is not an image batch (CLIP's 2-D token batches go through Forward too): channels-last
    applies to 4-D batches only, and the rows kept are the model's rows."""
    weights = torch.arange(77 * 4, dtype=torch.float32).reshape(77, 4)
    runtime = Runtime(torch.device("cpu"), Precision.BF16, channels_last=True)
    tokens = torch.arange(13 * 77).reshape(13, 77) % 11
    sizes = []
    out = Forward(lambda t: sizes.append(t.shape[0]) or t.float() @ weights, runtime, BATCH, exact=True)(tokens)
    assert sizes == [BATCH] and torch.equal(out, tokens.float() @ weights)


class CountsGraphs:
    """A torch.compile backend running graphs as they are (eager), counting per model the graphs compiled, the
    batches run by compiled code and the batch sizes; `model` is the model the zoo is evaluating."""

    def __init__(self):
        self.model = None
        self.graphs: dict[str, int] = {}
        self.compiled_sizes: dict[str, list[int]] = {}
        self.calls: dict[str, int] = {}
        self.entries_at_start: dict[str, int] = {}

    def __call__(self, graph, example_inputs):
        self.graphs[self.model] = self.graphs.get(self.model, 0) + 1

        def run(*args):
            images = [a for a in args if isinstance(a, torch.Tensor) and a.ndim == 4 and a.shape[1:] == (3, 224, 224)]
            self.compiled_sizes.setdefault(self.model, []).append(images[0].shape[0])
            return graph.forward(*args)
        return run

    def compile(self, model, **options):
        compiled = REAL_COMPILE(model, backend=self)

        def run(x):
            self.calls[self.model] = self.calls.get(self.model, 0) + 1
            return compiled(x)
        return run


REAL_COMPILE = torch.compile


@pytest.mark.slow
def test_the_zoo_compiles_each_model_afresh_once(tmp_path, monkeypatch, one_thread):
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: PLC0415 (the compiled code of a frame)

    data = synthetic.generate(tmp_path / "bg", per_class=1, seed=3).root
    specs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        torch.save(SmallCNN(9).state_dict(), tmp_path / f"cnn{seed}.pt")
        specs.append(f"{SMALL_CNN}@file:{tmp_path / f'cnn{seed}.pt'}")
    backend = CountsGraphs()
    monkeypatch.setattr(torch, "compile", backend.compile)
    evaluate_model = zoo.evaluate_model

    def evaluate_and_watch(loaded, spec, *args, **kwargs):
        backend.model = spec.text
        backend.entries_at_start[spec.text] = len(_debug_get_cache_entry_list(PixelModel.forward.__code__))
        return evaluate_model(loaded, spec, *args, **kwargs)

    monkeypatch.setattr(zoo, "evaluate_model", evaluate_and_watch)
    torch.compiler.reset()
    batch = 8
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = zoo.main(["--data-path", str(data), "--models", ",".join(specs), "--output-dir", str(tmp_path / "zoo"),
                         "--device", "cpu", "--no-progress", "--no-cache", "--no-leaderboard", "--compile",
                         "--batch-size", str(batch)])
    torch.compiler.reset()
    assert code == 0, out.getvalue()
    assert list(backend.entries_at_start.values()) == [0, 0]  # nothing compiled for an earlier model is kept
    for spec in specs:
        sizes = backend.compiled_sizes[spec]
        assert len(sizes) == backend.calls[spec]  # every batch ran compiled code: compilation never gave up
        assert set(sizes) == {batch}
        assert backend.graphs[spec] == 1
