"""On a CUDA GPU: the same numbers as on the CPU (down to the input floats), and reduced precision with fp32
re-checks agreeing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import fp32_formats
from tests.helpers import TINY_CLIP, save_torchscript
from tools import challenge
from tools.challenge import ChallengeConfig, list_challenge_files, run_challenge
from tools.data import synthetic
from tools.data.compositing import blend
from tools.data.pixels import unit_floats
from tools.in9 import IN9_MEAN, IN9_STD, VARIATIONS
from tools.in9.evaluate import evaluate_variations, list_in9_files
from tools.models.boundary import PixelModel
from tools.models.sources import load_model
from tools.runtime import Precision, Runtime

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def program(path):
    """The TorchScript file's model (TorchScript is code: trusted)."""
    return load_model(checkpoint=path, trust=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "color.ts"
    save_torchscript(synthetic.ColorEvidenceModel(9, trunk_width=16), path)
    return path


@pytest.mark.parametrize("channels_last", [False, True])
def test_in9_predictions_match_the_cpu(dataset, model_path, channels_last):
    loaded = program(model_path)
    cpu, _ = evaluate_variations(loaded, Runtime(torch.device("cpu")), list_in9_files(dataset.root, VARIATIONS, 2), 16,
                                 2, progress=False)
    gpu, _ = evaluate_variations(program(model_path), Runtime(torch.device("cuda"), channels_last=channels_last),
                                 list_in9_files(dataset.root, VARIATIONS, 2), 16, 2, progress=False)
    for name in VARIATIONS:
        assert np.array_equal(cpu[name].predictions, gpu[name].predictions), name


def test_challenge_verdicts_match_the_cpu(dataset, model_path, tmp_path):
    config = ChallengeConfig(batch_size=32, progress=False)
    cpu = run_challenge(program(model_path), Runtime(torch.device("cpu")), list_challenge_files(dataset.root, 4),
                        config,
                        output_dir=tmp_path / "cpu")
    gpu = run_challenge(program(model_path), Runtime(torch.device("cuda")), list_challenge_files(dataset.root, 4),
                        config,
                        output_dir=tmp_path / "gpu")
    assert cpu.state.verdict.tolist() == gpu.state.verdict.tolist()


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16, Precision.TF32])
def test_reduced_precision_with_recheck_gives_fp32_verdicts(dataset, model_path, tmp_path, precision):
    exact = run_challenge(program(model_path), Runtime(torch.device("cuda")), list_challenge_files(dataset.root, 4),
                          ChallengeConfig(batch_size=32, progress=False, full=True), output_dir=tmp_path / "fp32")
    fast = run_challenge(program(model_path), Runtime(torch.device("cuda"), precision),
                         list_challenge_files(dataset.root, 4),
                         ChallengeConfig(batch_size=32, progress=False, recheck_margin=1.0),
                         output_dir=tmp_path / "fast")
    assert fast.state.verdict.tolist() == exact.state.verdict.tolist()
    assert fast.unsure == 0
    assert (exact.state.verdict == challenge.VULNERABLE).any()


def test_fp32_repeats_bit_for_bit(dataset, model_path):
    """Two fp32 runs on one GPU give identical logits (no autotuning, deterministic cuDNN in fp32), including a
    resnet's convolutions."""
    import torchvision  # noqa: PLC0415

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=9).eval()
    x = torch.randint(0, 256, (24, 3, 224, 224), dtype=torch.uint8)
    outputs = []
    for _ in range(2):
        runtime = Runtime(torch.device("cuda"))
        model = runtime.prepare(torch.nn.Sequential(net))
        with torch.inference_mode():
            outputs.append(model(unit_floats(runtime.to_device(x))).cpu())
    assert torch.equal(outputs[0], outputs[1])
    assert not torch.backends.cudnn.benchmark and torch.backends.cudnn.deterministic


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.detach().cpu().contiguous().view(torch.int32)


@pytest.mark.parametrize("normalize", [False, True])
def test_pixel_model_inputs_are_the_cpu_floats_for_every_byte_value(normalize):
    """PixelModel's scaling (and normalisation) of all 256 byte values, bit for bit as on the CPU (a division
    by the CPU scalar 255 would give another float for 126 of them)."""
    images = torch.arange(256, dtype=torch.uint8).repeat(3).view(1, 3, 16, 16)
    model = PixelModel(torch.nn.Identity(), *((IN9_MEAN, IN9_STD) if normalize else (None, None))).eval()
    with torch.inference_mode():
        cpu = model(images)
        gpu = model.to("cuda")(images.to("cuda"))
    assert torch.equal(_bits(gpu), _bits(cpu))


def test_blend_is_the_cpu_s_for_every_byte_triple():
    """`--mask-arithmetic original` on the GPU: every (weight, foreground, background) byte triple blended to
    the CPU's float, bit for bit."""
    values = torch.arange(256, dtype=torch.uint8)
    weights = values.view(256, 1, 1, 1).expand(256, 1, 256, 256)
    fg = values.view(1, 1, 256, 1).expand(256, 1, 256, 256)
    bg = values.view(1, 1, 1, 256).expand(256, 1, 256, 256)
    cpu = blend(fg, bg, weights)
    gpu = blend(fg.to("cuda"), bg.to("cuda"), weights.to("cuda"))
    assert torch.equal(_bits(gpu), _bits(cpu))


FORMATS = {"torchvision eager": (fp32_formats.resnet, "eager", 224),
           "torchvision traced": (fp32_formats.resnet, "traced", 224),
           "torchvision scripted": (fp32_formats.resnet, "scripted", 224),
           "torchvision torch.export": (fp32_formats.resnet, "export", 224),
           "timm ViT": (fp32_formats.timm_vit, "eager", 32),
           "transformers ViT": (fp32_formats.hf_vit, "eager", 32)}


@pytest.mark.parametrize("name", list(FORMATS))
def test_fp32_logits_are_fp32_for_every_format(name, tmp_path):
    """The GPU's fp32 logits against the CPU's fp64 within fp32 rounding, through the loader and the exact
    forward pass: a traced program's baked TF32, fused attention in 3xTF32 or a fuser's kernels would be some
    2^13 times further off (tests/fp32_formats.py)."""
    build, kind, size = FORMATS[name]
    if name.startswith(("timm", "transformers")):
        pytest.importorskip(name.split()[0])
    deviation, bound = fp32_formats.deviations(build(), kind, Runtime(torch.device("cuda")), tmp_path, size)
    assert deviation <= bound, f"{name}: {deviation:.3g} from fp64, fp32 rounding allows {bound:.3g}"


def test_fp32_logits_of_a_clip_image_tower_are_fp32(tiny_clip, tmp_path):
    """open_clip's MultiheadAttention (its fast path a fused kernel of its own)."""
    deviation, bound = fp32_formats.deviations(fp32_formats.clip_image_tower(TINY_CLIP)(), "eager",
                                               Runtime(torch.device("cuda")), tmp_path, 32)
    assert deviation <= bound, f"{deviation:.3g} from fp64, fp32 rounding allows {bound:.3g}"


def test_full_matrix_equals_the_cpu_cell_by_cell(dataset, model_path, tmp_path):
    """`--full` in fp32 on the GPU: every (foreground, background) prediction the CPU's."""
    config = ChallengeConfig(batch_size=32, progress=False, full=True)
    cpu = run_challenge(program(model_path), Runtime(torch.device("cpu")), list_challenge_files(dataset.root, 4),
                        config,
                        output_dir=tmp_path / "cpu")
    gpu = run_challenge(program(model_path), Runtime(torch.device("cuda")), list_challenge_files(dataset.root, 4),
                        config,
                        output_dir=tmp_path / "gpu")
    assert cpu.state.matrix is not None and cpu.state.matrix.size > 0
    assert np.array_equal(cpu.state.matrix, gpu.state.matrix)


@pytest.mark.parametrize("channels_last", [False, True])
def test_compiled_pixel_model_inputs_are_the_cpu_floats(channels_last):
    """Under torch.compile (Inductor) on the GPU too, the input is the CPU's table floats: a gather, no division."""
    images = torch.arange(256, dtype=torch.uint8).repeat(3).view(1, 3, 16, 16).repeat(2, 1, 1, 1)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    model = PixelModel(torch.nn.Identity(), IN9_MEAN, IN9_STD).eval()
    with torch.inference_mode():
        cpu = model(images)
        gpu = torch.compile(model.to("cuda"), dynamic=False)(images.to("cuda"))
    assert torch.equal(_bits(gpu), _bits(cpu))


def test_the_device_check_passes_honest_fp32_and_catches_tf32():
    """A resnet's fp32 logits on the GPU are within fp32 rounding of float64 on the CPU; the same resnet forcing
    TF32 inside its forward (as a traced program's baked flags do) trips the check on an Ampere or newer GPU."""
    import torchvision  # noqa: PLC0415

    from tools.errors import UserError  # noqa: PLC0415
    from tools.models.boundary import LoadedModel  # noqa: PLC0415
    from tools.models.device_check import check_device  # noqa: PLC0415

    class ForcedTF32(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=False, allow_tf32=True):
                return self.inner(x)

    torch.manual_seed(0)
    net = torchvision.models.resnet18(num_classes=9).eval()
    images = torch.randint(0, 256, (4, 3, 224, 224), dtype=torch.uint8)
    honest = LoadedModel(PixelModel(net, IN9_MEAN, IN9_STD).eval(), 9, None, None, None, None, "test", "test")
    check = check_device(honest, Runtime(torch.device("cuda")), images)
    assert check.passed, check
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs an Ampere or newer GPU")
    forced = LoadedModel(PixelModel(ForcedTF32(net), IN9_MEAN, IN9_STD).eval(), 9, None, None, None, None, "t", "t")
    with pytest.raises(UserError, match="beyond fp32 rounding"):
        check_device(forced, Runtime(torch.device("cuda")), images)


@pytest.mark.parametrize("name, batch_size, channels_last", [
    ("resnet18", 256, False), ("resnet18", 256, True), ("resnet18", 7, False), ("resnet18", 1, False),
    ("vit_b_16", 256, False), ("vit_b_16", 7, False)])
def test_honest_models_are_verified_at_every_batch_shape_on_the_gpu(name, batch_size, channels_last):
    """An image's fp32 logits alone (a batch of copies of it) equal its logits beside other images, bit for bit, at
    one batch shape on the GPU too (cuDNN and cuBLAS choose by shape), so honest models never fail the start-up
    check's comparison; and a model computing batch statistics does."""
    import torchvision  # noqa: PLC0415

    from tools.errors import UserError  # noqa: PLC0415
    from tools.models.boundary import LoadedModel  # noqa: PLC0415
    from tools.models.device_check import check_device  # noqa: PLC0415

    class BatchStatistics(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x - x.mean(dim=0, keepdim=True))

    torch.manual_seed(0)
    net = getattr(torchvision.models, name)(num_classes=9).eval()
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8)
    runtime = Runtime(torch.device("cuda"), channels_last=channels_last)
    honest = LoadedModel(PixelModel(net, IN9_MEAN, IN9_STD).eval(), 9, None, None, None, None, "test", "test")
    check = check_device(honest, runtime, images, batch_size=batch_size)
    assert check.verified and check.batch_dependence is None, check
    if batch_size > 1:
        dependent = LoadedModel(PixelModel(BatchStatistics(net), IN9_MEAN, IN9_STD).eval(), 9, None, None, None, None,
                                "test", "test")
        with pytest.raises(UserError, match="change with the other images in its batch"):
            check_device(dependent, runtime, images, batch_size=batch_size)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_to_host_waits_for_the_copy_from_a_device_other_than_the_current_one():
    from tools.runtime import to_host  # noqa: PLC0415
    torch.cuda.set_device(0)
    device = torch.device("cuda:1")
    values = torch.arange(1 << 22, device=device, dtype=torch.float32)
    for _ in range(5):
        with torch.cuda.device(device):  # cuda:1's stream busy: an event on cuda:0's would pass at once
            torch.cuda._sleep(50_000_000)
        (host,), event = to_host(values * 2)
        assert event is not None
        event.synchronize()
        assert torch.equal(host, torch.arange(1 << 22, dtype=torch.float32) * 2)
