"""The exact mode's math: every precision leaf of torch's API set and restored, the attention and TorchScript kernels
inside an exact forward pass, and what is called exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tools.models.sources import load_model
from tools.runtime import Forward, Precision, Runtime, math_flags_kept

NEW_API = hasattr(torch.backends, "fp32_precision")  # torch >= 2.9
LEAVES = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn")
new_api_only = pytest.mark.skipif(not NEW_API, reason="torch's fp32_precision API is 2.9 and later")


def leaf(path: str):
    node = torch.backends
    for part in filter(None, path.split(".")):
        node = getattr(node, part)
    return node


def leaves() -> dict:
    """Every fp32_precision leaf as torch reports it, and the cuDNN choices."""
    state = {path: leaf(path).fp32_precision for path in LEAVES} if NEW_API else {}
    return {**state, "benchmark": torch.backends.cudnn.benchmark, "deterministic": torch.backends.cudnn.deterministic}


def legacy_getters() -> dict:
    """What the caller's legacy getters answer (or that they raise)."""
    answers = {}
    for name, get in {"matmul_precision": torch.get_float32_matmul_precision,
                      "matmul_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
                      "cudnn_tf32": lambda: torch.backends.cudnn.allow_tf32}.items():
        try:
            answers[name] = get()
        except RuntimeError:
            answers[name] = "raises"
    return answers


@pytest.fixture
def caller_state():
    """Whatever a test does to the flags, the next test starts from the process's state: saved and written back
    leaf by leaf, the legacy matmul precision first (it writes the matmul leaves)."""
    legacy = legacy_getters()["matmul_precision"]
    saved = leaves()
    yield
    if legacy != "raises":
        torch.set_float32_matmul_precision(legacy)
    for path in LEAVES if NEW_API else ():
        leaf(path).fp32_precision = saved[path]
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved["benchmark"], saved["deterministic"]


CALLER_STATES = {
    "torch's defaults": lambda: None,
    "medium matmul precision": lambda: torch.set_float32_matmul_precision("medium"),
    "cuDNN conv in TF32, RNN not": lambda: (setattr(torch.backends.cudnn.conv, "fp32_precision", "tf32"),
                                            setattr(torch.backends.cudnn.rnn, "fp32_precision", "ieee")),
    "CUDA matmul in TF32 by the new API": lambda: setattr(torch.backends.cuda.matmul, "fp32_precision", "tf32"),
    "everything ieee from the top": lambda: setattr(torch.backends, "fp32_precision", "ieee"),
}


@new_api_only
@pytest.mark.parametrize("precision", list(Precision))
@pytest.mark.parametrize("state", list(CALLER_STATES))
def test_every_leaf_is_set_for_the_precision_and_restored_for_the_caller(state, precision, caller_state):
    """Whatever the caller set (by the legacy or the new API, consistently or not), a runtime starts, sets every
    leaf, and `math_flags_kept` (what `benchmark()` runs under) gives the caller back every leaf and every
    getter's answer."""
    CALLER_STATES[state]()
    before, answers = leaves(), legacy_getters()
    with math_flags_kept():
        runtime = Runtime(torch.device("cpu"), precision)
        inside = leaves()
        expected = {path: "ieee" for path in LEAVES}
        if precision is Precision.TF32:
            expected.update({path: "tf32" for path in ("cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn")})
        assert {path: inside[path] for path in LEAVES} == expected
        assert (inside["benchmark"], inside["deterministic"]) == (precision is not Precision.FP32,
                                                                  precision is Precision.FP32)
        with runtime.fp32_math():
            assert {path: leaf(path).fp32_precision for path in LEAVES} == {path: "ieee" for path in LEAVES}
        assert leaves() == inside
        # the legacy getters a model's code may read agree with the leaves instead of raising
        assert legacy_getters() == {"matmul_precision": "high" if precision is Precision.TF32 else "highest",
                                    "matmul_tf32": precision is Precision.TF32,
                                    "cudnn_tf32": precision is Precision.TF32}
    assert leaves() == before
    assert legacy_getters() == answers


def test_the_legacy_flags_where_torch_has_no_leaves(monkeypatch, caller_state):
    """On torch before 2.9 (simulated: no leaves), the legacy matmul precision and cuDNN's TF32 flag are set and
    restored."""
    import tools.runtime.precision  # noqa: PLC0415

    monkeypatch.setattr(tools.runtime.precision, "precision_api", lambda: False)
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.allow_tf32 = True
    with math_flags_kept():
        Runtime(torch.device("cpu"))
        assert legacy_getters() == {"matmul_precision": "highest", "matmul_tf32": False, "cudnn_tf32": False}
        Runtime(torch.device("cpu"), Precision.TF32)
        assert legacy_getters() == {"matmul_precision": "high", "matmul_tf32": True, "cudnn_tf32": True}
    assert legacy_getters() == {"matmul_precision": "medium", "matmul_tf32": True, "cudnn_tf32": True}


@new_api_only
def test_benchmark_gives_the_caller_back_a_state_its_getters_read(dataset, caller_state):
    """After `benchmark()`, a caller that had set "medium" matmul precision and cuDNN's convolutions apart from its
    RNNs by the new API finds every leaf as it was, and `torch.get_float32_matmul_precision()` answers (it
    raised after a run before)."""
    from tests.helpers import TinyCNN  # noqa: PLC0415
    from tools import benchmark  # noqa: PLC0415

    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.conv.fp32_precision, torch.backends.cudnn.rnn.fp32_precision = "tf32", "ieee"
    before, answers = leaves(), legacy_getters()
    assert answers["matmul_precision"] == "medium"
    benchmark(TinyCNN(9, seed=3), dataset.root, num_classes=9, variations=["original"], challenge=False,
              device="cpu", batch_size=8, workers=1, progress=False, cache=False)
    assert leaves() == before
    assert legacy_getters() == answers


class OpsRun(TorchDispatchMode):
    """The aten operations that run inside the block."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def switches() -> dict:
    """What decides the attention and TorchScript kernels (a dispatch mode in inference mode sees only
    `scaled_dot_product_attention` itself, not the backend it picks)."""
    cuda = torch.backends.cuda
    return {"graph_optimisation": torch._C._get_graph_executor_optimize(),
            "fusers": (torch._C._jit_can_fuse_on_cpu(), torch._C._jit_can_fuse_on_gpu(),
                       torch._C._jit_texpr_fuser_enabled()),
            "mha_fastpath": torch.backends.mha.get_fastpath_enabled(),
            "sdpa": (cuda.math_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(),
                     cuda.cudnn_sdp_enabled())}


EXACT_SWITCHES = {"graph_optimisation": False, "fusers": (False, False, False), "mha_fastpath": False,
                  "sdpa": (True, False, False, False)}


class Attends(torch.nn.Module):
    """Attention both ways models reach it: `scaled_dot_product_attention` (timm, transformers, torchvision's
    ViT through MultiheadAttention) and `nn.MultiheadAttention` in eval mode (open_clip), whose fast path is a
    fused kernel of its own. Records the TorchScript and attention switches it runs under."""

    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True)
        self.seen: list[tuple] = []

    def forward(self, x):
        self.seen.append(switches())
        tokens = x.flatten(1).view(x.shape[0], -1, 8)
        q = tokens.view(x.shape[0], 2, -1, 4)
        attended = F.scaled_dot_product_attention(q, q, q).flatten(1)
        return attended.sum(1, keepdim=True) + self.mha(tokens, tokens, tokens, need_weights=False)[0].flatten(1)


FUSED = {"aten._scaled_dot_product_flash_attention_for_cpu", "aten._native_multi_head_attention",
         "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_flash_attention",
         "aten._scaled_dot_product_cudnn_attention"}


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.BF16])
def test_attention_runs_its_math_backend_in_every_exact_forward(precision):
    """The exact forward (fp32) and the fp32 re-check of a reduced precision: only the math attention backend,
    no MultiheadAttention fast path, no TorchScript fuser or graph optimisation; all as they were afterwards."""
    torch.manual_seed(0)
    model = Attends().eval()
    runtime = Runtime(torch.device("cpu"), precision)
    x = torch.randn(3, 4, 4, 4)
    before = switches()
    assert before != EXACT_SWITCHES
    with torch.inference_mode():
        eager = model(x)
    model.seen.clear()
    exact = Forward(model, runtime, chunk=4, exact=precision is not Precision.FP32)(x)
    assert model.seen == [EXACT_SWITCHES]
    assert switches() == before
    torch.testing.assert_close(exact, eager)  # the same attention, by other kernels


def test_under_the_exact_switches_no_fused_attention_kernel_runs():
    """What those switches do (seen outside inference mode, where a dispatch mode sees the kernels chosen): the
    CPU's flash attention and MultiheadAttention's native kernel by default, neither in the exact kernels."""
    from tools.runtime import exact_kernels  # noqa: PLC0415

    torch.manual_seed(0)
    model, x = Attends().eval(), torch.randn(3, 4, 4, 4)
    with torch.no_grad(), OpsRun() as fast:
        model(x)
    assert {"aten._scaled_dot_product_flash_attention_for_cpu", "aten._native_multi_head_attention"} <= fast.ops
    with torch.no_grad(), exact_kernels(), OpsRun() as exact:
        model(x)
    assert not FUSED & exact.ops, sorted(FUSED & exact.ops)
    assert "aten.bmm" in exact.ops


def test_fp32_compiled_is_not_exact_and_says_so():
    """Inductor generates kernels of its own (an approximate division among them): fp32 with --compile is a
    speed mode, recorded as not exact, and near ties are re-checked as in the other speed modes."""
    from tools.challenge import ChallengeConfig  # noqa: PLC0415

    eager, compiled = Runtime(torch.device("cpu")), Runtime(torch.device("cpu"), compile=True)
    assert eager.exact and not compiled.exact
    assert eager.describe()["exact_mode"] and not compiled.describe()["exact_mode"]
    assert not eager.describe()["exact"]  # a claim only the start-up check makes (tests/test_models_device_check.py)
    assert compiled.recheck_margin(ChallengeConfig().recheck_margin) == ChallengeConfig().recheck_margin > 0
    assert eager.recheck_margin(ChallengeConfig().recheck_margin) == 0


def test_the_provenance_records_the_math_that_ran():
    math = Runtime(torch.device("cpu")).describe()["math"]
    assert math["sdpa_backends"] == ["math"]
    assert not math["mha_fastpath"] and not math["jit_fuse_gpu"] and not math["torchscript_optimized"]
    assert math["cudnn.deterministic"] and not math["cudnn.benchmark"]
    if NEW_API:
        assert {math[f"{path}.fp32_precision".lstrip(".")] for path in LEAVES} == {"ieee"}
    bf16 = Runtime(torch.device("cpu"), Precision.BF16).describe()["math"]
    assert "flash" in bf16["sdpa_backends"] and bf16["cudnn.benchmark"]


def test_a_results_provenance_names_the_decoder_and_the_math_that_ran(dataset, color_ts):
    """Another libjpeg decodes the same JPEG to other pixels (a Pillow without libjpeg-turbo changes predictions),
    so the decoder is part of what a result came from; and so is the math mode that ran."""
    import PIL  # noqa: PLC0415
    from PIL import features  # noqa: PLC0415

    from tools.in9.evaluate import In9Config, list_in9_files, run_in9  # noqa: PLC0415

    runtime = Runtime(torch.device("cpu"))
    run = run_in9(load_model(checkpoint=color_ts[9], trust=True, runtime=runtime), runtime,
                  list_in9_files(dataset.root, ["original"], 1),
                  In9Config(("original",), 16, workers=1, progress=False))
    info = run.to_json()["provenance"]
    assert {**info["decoder"], "used": None} == {"used": None, "pillow": PIL.__version__,
                                                 "libjpeg": features.version("jpg"),
                                                 "libjpeg_turbo": features.version_feature("libjpeg_turbo")
                                                 if features.check_feature("libjpeg_turbo") else None}
    assert info["exact_mode"] and info["math"]["sdpa_backends"] == ["math"] and not info["math"]["mha_fastpath"]


@pytest.mark.parametrize("name", ["torchvision traced", "timm ViT", "transformers ViT", "CLIP image tower"])
@pytest.mark.slow
def test_the_fp32_against_fp64_check_passes_fp32_and_catches_bf16(name, tmp_path, request):
    """The check `tests/test_gpu.py` runs on CUDA, run on the CPU: fp32 through the loader and the exact forward
    is within fp32 rounding of fp64, and a bf16 runtime is caught."""
    from tests import fp32_formats  # noqa: PLC0415
    from tests.helpers import TINY_CLIP  # noqa: PLC0415

    if name.startswith(("timm", "transformers")):
        pytest.importorskip(name.split()[0])
    if name.startswith("CLIP"):
        request.getfixturevalue("tiny_clip")  # registers the architecture
    build, kind, size = {"torchvision traced": (fp32_formats.resnet, "traced", 224),
                         "timm ViT": (fp32_formats.timm_vit, "eager", 32),
                         "transformers ViT": (fp32_formats.hf_vit, "eager", 32),
                         "CLIP image tower": (fp32_formats.clip_image_tower(TINY_CLIP), "eager", 32)}[name]
    net, cpu = build(), torch.device("cpu")
    deviation, bound = fp32_formats.deviations(net, kind, Runtime(cpu), tmp_path, size)
    assert 0 <= deviation <= bound
    reduced, bound = fp32_formats.deviations(net, "eager", Runtime(cpu, Precision.BF16), tmp_path, size)
    assert reduced > bound


class SeesTheFlags(torch.nn.Module):
    """Records the math flags in effect when its forward runs."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision()))
        return x * 2


def test_the_exact_forward_reasserts_fp32_flags_changed_after_the_runtime_was_built():
    """A flag another library (or the user) changes after the Runtime was made cannot reach an fp32 run."""
    with math_flags_kept():
        runtime = Runtime(torch.device("cpu"), Precision.FP32)
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("medium")
        model = SeesTheFlags()
        Forward(model, runtime, chunk=4)(torch.zeros(3, 1))
        assert model.seen == [(False, "highest")]
        assert torch.backends.cudnn.allow_tf32 and torch.get_float32_matmul_precision() == "medium"  # restored
