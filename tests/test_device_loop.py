"""The device-side loop, checked on the CPU: nothing in the challenge's launch path waits for the device; a whole
--compile run compiles one graph; the reduced-precision re-check runs the eager module in true fp32, in the
challenge and in in9."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tools.challenge import ChallengeConfig, list_challenge_files, run_challenge
from tools.challenge.predictor import CompositePredictor
from tools.data import synthetic
from tools.in9 import IN9_MEAN, IN9_STD, VARIATIONS
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.models.architectures import SmallCNN
from tools.models.boundary import LoadedModel, PixelModel
from tools.runtime import Precision, Runtime

BATCH = 12
SYNCS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::item", "aten::is_nonzero"}


def small_cnn(seed: int = 0) -> LoadedModel:
    torch.manual_seed(seed)
    return LoadedModel(PixelModel(SmallCNN(9), IN9_MEAN, IN9_STD), 9, None, None, None, None, "test", "test")


class RecordsOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.slow
def test_the_launch_path_never_waits_for_the_device(dataset, monkeypatch, full, one_thread):
    """bf16 with a re-check margin that makes near ties everywhere: launching a batch (composite, predict, top-two
    margins, copies back) calls no op that reads a device value on the host."""
    launch, seen, launches = CompositePredictor.launch, set(), []

    def watched(self, pairs):
        with RecordsOps() as recorder:
            launched = launch(self, pairs)
        seen.update(recorder.ops)
        launches.append(len(pairs))
        return launched

    monkeypatch.setattr(CompositePredictor, "launch", watched)
    config = ChallengeConfig(batch_size=BATCH, progress=False, full=full, recheck_margin=0.5)
    result = run_challenge(small_cnn(), Runtime(torch.device("cpu"), Precision.BF16),
                           list_challenge_files(dataset.root, 1), config, workers=1)
    assert launches and result.rechecked > 0
    assert "aten::topk" in seen  # the recorder saw the launch's ops
    assert not seen & SYNCS, seen & SYNCS


class CountsGraphs:
    """A torch.compile backend that runs graphs eagerly, counting them and whether autocast was on in each call."""

    def __init__(self):
        self.graphs, self.autocast = 0, []

    def backend(self, graph, example_inputs):
        self.graphs += 1

        def run(*args):
            self.autocast.append(torch.is_autocast_enabled("cpu"))
            return graph.forward(*args)
        return run


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.slow
def test_a_compiled_bf16_challenge_compiles_one_graph_and_rechecks_eagerly(dataset, monkeypatch, full, one_thread):
    counter, real_compile = CountsGraphs(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **options: real_compile(model, backend=counter.backend,
                                                                                  **options))
    torch.compiler.reset()
    runtime = Runtime(torch.device("cpu"), Precision.BF16, compile=True)
    config = ChallengeConfig(batch_size=BATCH, progress=False, full=full, recheck_margin=0.5)
    try:
        result = run_challenge(small_cnn(), runtime, list_challenge_files(dataset.root, 1), config, workers=1)
        compiled = counter.graphs
    finally:
        torch.compiler.reset()
    assert result.rechecked > 0  # the fp32 re-check ran, and never through compiled code
    assert compiled == 1 and counter.autocast and all(counter.autocast)


@pytest.mark.slow
def test_in9_rechecks_near_ties_in_reduced_precision(dataset, one_thread):
    """bf16 with every prediction a near tie: every image re-checked, and the predictions are fp32's; the counts
    are in the results JSON."""
    exact = run_in9(small_cnn(), Runtime(torch.device("cpu")), list_in9_files(dataset.root, VARIATIONS, 1),
                    In9Config(batch_size=BATCH, workers=1, progress=False))
    fast = run_in9(small_cnn(), Runtime(torch.device("cpu"), Precision.BF16),
                   list_in9_files(dataset.root, VARIATIONS, 1),
                   In9Config(batch_size=BATCH, workers=1, progress=False, recheck_margin=1e9))
    total = sum(r.total for r in fast.results.values())
    for name in VARIATIONS:
        assert np.array_equal(fast.results[name].predictions, exact.results[name].predictions), name
        assert fast.results[name].rechecked == fast.results[name].total
    payload = fast.to_json()
    assert (payload["rechecked_fp32"] == total
            and payload["original"]["rechecked_fp32"] == fast.results["original"].total)
    assert exact.to_json()["rechecked_fp32"] == 0


def colour_model() -> LoadedModel:
    return LoadedModel(PixelModel(synthetic.ColorEvidenceModel(9), IN9_MEAN, IN9_STD), 9, None, None, None, None,
                       "test", "test")


@pytest.mark.parametrize("full,stop", [(False, 16), (False, 36), (True, 16)])
@pytest.mark.slow
def test_a_bf16_run_with_rechecks_resumed_mid_run_is_the_same_run(dataset, tmp_path, monkeypatch, full, stop,
                                                                  one_thread):
    """bf16 with some near ties held for their re-check (the colour model: robust and vulnerable foregrounds, so
    late rounds with few open foregrounds, where the batches held decide which pairs are planned): stopped as a
    batch is launched (the state saved after every batch, with the batches in flight and held) and resumed, the
    run tests the same pairs and finds the same verdicts, fooling backgrounds, margins and statistics as the
    uninterrupted one."""
    runtime = Runtime(torch.device("cpu"), Precision.BF16)
    config = ChallengeConfig(batch_size=3, progress=False, full=full, recheck_margin=0.5, save_every=0.0)
    whole = run_challenge(colour_model(), runtime, list_challenge_files(dataset.root, 1), config,
                          output_dir=tmp_path / "whole", workers=1)
    launch, calls = CompositePredictor.launch, []

    def interrupted(self, pairs):
        calls.append(len(pairs))
        if len(calls) == stop:
            raise KeyboardInterrupt
        return launch(self, pairs)

    monkeypatch.setattr(CompositePredictor, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_challenge(colour_model(), runtime, list_challenge_files(dataset.root, 1), config,
                      output_dir=tmp_path / "part", workers=1)
    monkeypatch.setattr(CompositePredictor, "launch", launch)
    resumed = run_challenge(colour_model(), runtime, list_challenge_files(dataset.root, 1), config,
                            output_dir=tmp_path / "part", resume=True,
                            workers=1)
    assert 0 < whole.rechecked < whole.state.evaluated
    for name in ("verdict", "fool_bg", "fool_pred", "min_margin", "tested", "evaluated", "successes", "trials"):
        assert np.array_equal(getattr(resumed.state, name), getattr(whole.state, name)), name
    if full:
        assert np.array_equal(resumed.state.matrix, whole.state.matrix)


class RecordsHostReads(torch.overrides.TorchFunctionMode):
    """Tensor methods that read a tensor's values on the host (a wait for the device where the tensor is there),
    outside the points allowed to wait (`paused`)."""

    READS = {"cpu", "numpy", "item", "tolist", "nonzero", "__bool__", "__int__", "__float__"}

    def __init__(self):
        super().__init__()
        self.reads: set[str] = set()
        self.paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused and name in self.READS:
            self.reads.add(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
@pytest.mark.slow
def test_in9_launch_path_never_waits_for_the_device(dataset, monkeypatch, precision, one_thread):
    """in9 in fp32 and in bf16 with near ties everywhere: between the points allowed to wait (a batch's results
    copied back, waited for `IN_FLIGHT` batches later; the fp32 re-check of the queued ties), the loop calls no
    op that reads a device value on the host (no `nonzero`, `.item()`, blocking `.cpu()` of a batch's results)."""
    from tools.runtime import inflight  # noqa: PLC0415
    host, ops = RecordsHostReads(), RecordsOps()

    def allowed(method):
        def run(*args, **kwargs):
            host.paused += 1
            try:
                with torch.utils._python_dispatch._disable_current_modes():
                    return method(*args, **kwargs)
            finally:
                host.paused -= 1
        return run

    monkeypatch.setattr(inflight.Launched, "wait", allowed(inflight.Launched.wait))
    monkeypatch.setattr(inflight.Pipeline, "_recheck", allowed(inflight.Pipeline._recheck))
    monkeypatch.setattr(inflight, "to_host", allowed(inflight.to_host))  # non-blocking from a GPU (a no-op here)
    runtime = Runtime(torch.device("cpu"), precision)
    config = In9Config(batch_size=BATCH, workers=1, progress=False, recheck_margin=1e9)
    files, model = list_in9_files(dataset.root, VARIATIONS, workers=1), small_cnn()  # before any batch
    with host, ops:
        run = run_in9(model, runtime, files, config)
    assert "aten::argmax" in ops.ops  # the recorders saw the batches
    assert not host.reads, host.reads
    assert not ops.ops & SYNCS, ops.ops & SYNCS
    assert (run.to_json()["rechecked_fp32"] > 0) == (precision is Precision.BF16)


def test_in9_rechecks_its_near_ties_in_the_runtime_memory_format(dataset, one_thread):
    """bf16 in channels-last with every prediction a near tie: the held ties' images reach the fp32 re-check in
    channels-last, as the batches do and as the re-check's padded chunks are (one layout for the model)."""
    loaded, layouts = small_cnn(), []

    def record(module, inputs):
        if not torch.is_autocast_enabled("cpu"):  # the fp32 re-check
            layouts.append(inputs[0].is_contiguous(memory_format=torch.channels_last))

    loaded.model.register_forward_pre_hook(record)
    runtime = Runtime(torch.device("cpu"), Precision.BF16, channels_last=True)
    run = run_in9(loaded, runtime, list_in9_files(dataset.root, ["original"], 1),
                  In9Config(("original",), batch_size=BATCH, workers=1, progress=False, recheck_margin=1e9))
    assert run.results["original"].rechecked == run.results["original"].total
    assert layouts and all(layouts), layouts


class OverflowsInReducedPrecision(torch.nn.Module):
    """The classifier's logits, but under autocast every other image's are NaN, as an activation past fp16's range
    leaves them (inf - inf): their top-two margin is NaN too."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        logits = self.inner(x)
        if torch.is_autocast_enabled(x.device.type):
            logits = logits.clone()
            logits[::2] = float("nan")
        return logits


def overflowing_model() -> LoadedModel:
    """The colour model (predictions that vary, with wide margins), overflowing under autocast."""
    return LoadedModel(PixelModel(OverflowsInReducedPrecision(synthetic.ColorEvidenceModel(9)), IN9_MEAN, IN9_STD), 9,
                       None, None, None, None, "test", "test")


@pytest.mark.slow
def test_a_nan_margin_of_reduced_precision_is_rechecked_or_unsure(dataset, one_thread):
    """A prediction from NaN logits (reduced precision's overflow) is no sure one: re-checked in fp32 like a near
    tie, so in9's predictions and the challenge's verdicts are fp32's; with the re-check off, a verdict resting on
    it is counted unsure."""
    config = In9Config(batch_size=BATCH, workers=1, progress=False)
    exact = run_in9(overflowing_model(), Runtime(torch.device("cpu")), list_in9_files(dataset.root, VARIATIONS, 1),
                    config)
    fast = run_in9(overflowing_model(), Runtime(torch.device("cpu"), Precision.BF16),
                   list_in9_files(dataset.root, VARIATIONS, 1), config)
    for name in VARIATIONS:
        assert np.array_equal(fast.results[name].predictions, exact.results[name].predictions), name
        assert fast.results[name].rechecked >= fast.results[name].total // 2
    exact = run_challenge(overflowing_model(), Runtime(torch.device("cpu")), list_challenge_files(dataset.root, 1),
                          ChallengeConfig(batch_size=BATCH, progress=False, full=True), workers=1)
    fast = run_challenge(overflowing_model(), Runtime(torch.device("cpu"), Precision.BF16),
                         list_challenge_files(dataset.root, 1),
                         ChallengeConfig(batch_size=BATCH, progress=False), workers=1)
    assert fast.state.verdict.tolist() == exact.state.verdict.tolist() and fast.unsure == 0
    off = run_challenge(overflowing_model(), Runtime(torch.device("cpu"), Precision.BF16),
                        list_challenge_files(dataset.root, 1),
                        ChallengeConfig(batch_size=BATCH, progress=False, recheck_margin=0.0), workers=1)
    wrong = off.state.verdict != exact.state.verdict
    assert wrong.any() and off.unsure >= int(wrong.sum())
