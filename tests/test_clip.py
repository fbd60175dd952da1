"""The clip:ARCH/PRETRAINED model source with a tiny randomly initialised open_clip model (no download): the
zero-shot head against the prompt computation done by hand, the logits against open_clip's own image
features, both scripts against brute-force references, and the one-line errors (missing extra, offline)."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import challenge_eval
import in9_eval
from conftest import TINY_CLIP, run_in_process
from reference import evaluate as reference_evaluate
from tests.challenge_reference import reference_matrix, reference_verdicts
from tools import cli, synthetic
from tools.clip_zero_shot import RANDOM_SEED, parse_spec, template_sets
from tools.errors import UserError
from tools.in9 import class_names
from tools.sources import load_model

ACCURACY_LINE = re.compile(r"^Accuracy on (\w+) is (\d+\.\d\d)%$", re.MULTILINE)
SUMMARY_LINE = re.compile(r"^Summary: (\d+)/(\d+) ", re.MULTILINE)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("clipdata") / "bg_challenge", per_class=2, seed=3).root


@pytest.fixture(scope="module")
def loaded(tiny_clip):
    return load_model(tiny_clip)


def same_random_clip():
    """The open_clip model the source builds for clip:TINY/none, text tower included."""
    import open_clip
    with torch.random.fork_rng():
        torch.manual_seed(RANDOM_SEED)
        return open_clip.create_model(TINY_CLIP, pretrained=None).eval()


def run_script(script, argv, capsys):
    return run_in_process(lambda a: cli.run_main(script.build_parser(), script.main, a), argv, capsys)


def test_spec_parsing():
    assert parse_spec("ViT-B-32/openai") == ("ViT-B-32", "openai")
    assert parse_spec("ViT-B-32/none") == ("ViT-B-32", None)
    assert parse_spec("ViT-B-32") == ("ViT-B-32", None)
    assert parse_spec("ViT-B-32//data/weights.pt") == ("ViT-B-32", "/data/weights.pt")
    with pytest.raises(UserError, match="names no architecture"):
        parse_spec("/openai")


def test_head_equals_the_prompt_embeddings_done_by_hand(loaded, one_thread):
    import open_clip
    model = same_random_clip()
    tokenizer = open_clip.get_tokenizer(TINY_CLIP)
    classifier = loaded.model.classifier
    for key, value in model.visual.state_dict().items():  # the same random model
        assert torch.equal(value, classifier.visual.state_dict()[key])
    templates = template_sets()["openai"]
    rows = []
    with torch.no_grad():
        for name in class_names():
            total = torch.zeros(16)
            for template in templates:
                embedding = model.encode_text(tokenizer([template(name)]))[0]
                total += embedding / embedding.norm()
            mean = total / len(templates)
            rows.append(mean / mean.norm())
    expected = torch.stack(rows)
    assert classifier.head.shape == (9, 16)
    torch.testing.assert_close(classifier.head, expected, rtol=0, atol=1e-5)
    assert float(classifier.logit_scale) == pytest.approx(model.logit_scale.exp().item())
    assert loaded.num_classes == 9 and loaded.arch == f"clip:{TINY_CLIP}" and loaded.weights == "none"


def test_logits_are_scaled_cosines_with_clip_statistics_and_resizing(loaded, one_thread):
    import open_clip
    model = same_random_clip()
    preprocess = open_clip.get_model_preprocess_cfg(model)
    images = torch.randint(0, 256, (3, 3, 224, 224), dtype=torch.uint8)
    x = (images.float() / 255 - torch.tensor(preprocess["mean"]).view(1, 3, 1, 1)) / \
        torch.tensor(preprocess["std"]).view(1, 3, 1, 1)
    x = F.interpolate(x, size=(32, 32), mode="bicubic", antialias=True)
    with torch.no_grad():
        features = model.encode_image(x, normalize=True)
        expected = model.logit_scale.exp() * features @ loaded.model.classifier.head.T
        got = loaded.model(images)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_in9_eval_runs_with_clip_and_matches_a_brute_force_reference(tiny_clip, loaded, data, tmp_path, capsys,
                                                                     one_thread):
    code, out, err = run_script(in9_eval, ["--data-path", str(data), "--arch", tiny_clip, "--eval-dataset", "all",
                                           "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path)], capsys)
    assert code == 0, err
    printed = dict(ACCURACY_LINE.findall(out))
    assert len(printed) == 8
    statistics = (loaded.model.mean.flatten().tolist(), loaded.model.std.flatten().tolist())
    for variation in ("original", "mixed_rand", "only_bg_t"):
        reference = reference_evaluate(loaded.model.classifier, data, variation, 9, statistics)
        assert printed[variation] == f"{reference.accuracy:.2f}"


def test_challenge_eval_runs_with_clip_and_matches_a_brute_force_reference(tiny_clip, loaded, data, tmp_path,
                                                                           capsys, one_thread):
    code, out, err = run_script(challenge_eval, ["--data-path", str(data), "--arch", tiny_clip, "--device", "cpu",
                                                 "--no-progress", "--no-cache", "--output-dir", str(tmp_path)], capsys)
    assert code == 0, err
    mean, std = loaded.model.mean.flatten().tolist(), loaded.model.std.flatten().tolist()
    matrix, fg_labels, bg_labels = reference_matrix(data, loaded.model.classifier, mean, std)
    vulnerable = reference_verdicts(matrix, fg_labels, bg_labels, "any")
    assert SUMMARY_LINE.search(out).groups() == (str(int(vulnerable.sum())), str(len(vulnerable)))


def test_without_open_clip_one_error_line_with_the_install_hint(data, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)  # makes `import open_clip` raise ImportError
    with pytest.raises(UserError, match=r"pip install open_clip_torch"):
        load_model("clip:ViT-B-32/openai")
    code, out, err = run_script(in9_eval, ["--data-path", str(data), "--arch", "clip:ViT-B-32/openai",
                                           "--device", "cpu"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in err
    assert "[clip] extra" in err


def test_offline_download_is_one_error_line(data, capsys, monkeypatch):
    open_clip = pytest.importorskip("open_clip")

    def offline(*args, **kwargs):
        raise OSError("[Errno -2] Name or service not known")

    monkeypatch.setattr(open_clip, "download_pretrained", offline)
    code, out, err = run_script(challenge_eval, ["--data-path", str(data), "--arch", "clip:ViT-B-32/openai",
                                                 "--device", "cpu", "--no-cache"], capsys)
    assert code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: cannot download the CLIP weights clip:ViT-B-32/openai")
    assert "Name or service not known" in line


@pytest.mark.parametrize("arch, kwargs, message", [
    ("clip:ViT-B-33/openai", {}, r"unknown open_clip architecture 'ViT-B-33' \(close matches: ViT-B-32"),
    (f"clip:{TINY_CLIP}/no-such-tag", {}, "neither a pretrained tag .* nor a file"),
    ("clip:ViT-B-32/openai", {"weights": "IMAGENET1K_V1"}, "drop --checkpoint, --weights and --normalize"),
])
def test_bad_clip_specs(tiny_clip, arch, kwargs, message):
    with pytest.raises(UserError, match=message):
        load_model(arch, **kwargs)


def test_random_initialisation_is_reproducible(tiny_clip, loaded, one_thread):
    again = load_model(tiny_clip)
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again.model(images), loaded.model(images))
    assert again.sha256 == loaded.sha256 and np.isfinite(float(loaded.model.classifier.logit_scale))
