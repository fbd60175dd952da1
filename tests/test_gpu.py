"""On a CUDA GPU: the same numbers as on the CPU, and reduced precision with fp32 re-checks agreeing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import save_torchscript
from tools import challenge, synthetic
from tools.challenge import ChallengeConfig, run_challenge
from tools.evaluate import evaluate_variations
from tools.in9 import VARIATIONS
from tools.sources import load_model
from tools.runtime import Precision, Runtime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "color.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9, trunk_width=16), path)
    return path


@pytest.mark.parametrize("channels_last", [False, True])
def test_in9_predictions_match_the_cpu(dataset, model_path, channels_last):
    loaded = load_model(checkpoint=model_path)
    cpu = evaluate_variations(loaded, Runtime(torch.device("cpu")), dataset.root, VARIATIONS, 16, 2, progress=False)
    gpu = evaluate_variations(load_model(checkpoint=model_path), Runtime(torch.device("cuda"), channels_last=channels_last),
                              dataset.root, VARIATIONS, 16, 2, progress=False)
    for name in VARIATIONS:
        assert np.array_equal(cpu[name].predictions, gpu[name].predictions), name


def test_challenge_verdicts_match_the_cpu(dataset, model_path, tmp_path):
    config = ChallengeConfig(batch_size=32, progress=False)
    cpu = run_challenge(load_model(checkpoint=model_path), Runtime(torch.device("cpu")), dataset.root, config,
                        output_dir=tmp_path / "cpu")
    gpu = run_challenge(load_model(checkpoint=model_path), Runtime(torch.device("cuda")), dataset.root, config,
                        output_dir=tmp_path / "gpu")
    assert cpu.state.verdict.tolist() == gpu.state.verdict.tolist()


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16, Precision.TF32])
def test_reduced_precision_with_recheck_gives_fp32_verdicts(dataset, model_path, tmp_path, precision):
    exact = run_challenge(load_model(checkpoint=model_path), Runtime(torch.device("cuda")), dataset.root,
                          ChallengeConfig(batch_size=32, progress=False, full=True), output_dir=tmp_path / "fp32")
    fast = run_challenge(load_model(checkpoint=model_path), Runtime(torch.device("cuda"), precision), dataset.root,
                         ChallengeConfig(batch_size=32, progress=False, recheck_margin=1.0), output_dir=tmp_path / "fast")
    assert fast.state.verdict.tolist() == exact.state.verdict.tolist()
    assert fast.unsure == 0
    assert (exact.state.verdict == challenge.VULNERABLE).any()


def test_fp32_repeats_bit_for_bit(dataset, model_path):
    """Two fp32 runs on one GPU give identical logits (no autotuning in fp32), including a resnet's convolutions."""
    import torchvision  # noqa: PLC0415

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=9).eval()
    x = torch.randint(0, 256, (24, 3, 224, 224), dtype=torch.uint8)
    outputs = []
    for _ in range(2):
        runtime = Runtime(torch.device("cuda"))
        model = runtime.prepare(torch.nn.Sequential(net))
        with torch.inference_mode():
            outputs.append(model(runtime.to_device(x).float().div_(255)).cpu())
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.backends.cudnn.benchmark
