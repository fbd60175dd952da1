"""The clip:ARCH/PRETRAINED model source with a tiny randomly initialised open_clip model (no download): both
zero-shot heads (the 1000 ImageNet class names, the default; nine IN-9 prompts) against the prompt computation
done by hand, the default through the ImageNet->IN-9 map, the head and its templates in the model's identity
and its cache, the logits against open_clip's own image features, both scripts against brute-force
references, the leaderboard's classes column, and the one-line errors (bad options, missing extra, offline)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import challenge_eval
import in9_eval
from tests.challenge_reference import reference_matrix, reference_verdicts
from tests.helpers import TINY_CLIP, TINY_CLIP_OPTIONS, files_read, run_in_process, unrecorded_reads
from tests.reference import evaluate as reference_evaluate
from tools.data import synthetic
from tools.data.hashing import sha256_file
from tools.data.store import DecodedCache
from tools.errors import UserError
from tools.in9 import VARIATIONS
from tools.in9.evaluate import In9Config, list_in9_files, run_in9
from tools.models import clip as clip_zero_shot
from tools.models.clip import RANDOM_SEED, ClipSpec, Head, Templates, parse_spec, prompts, template_sets
from tools.models.sources import load_model
from tools.results.leaderboard import measured_row, published_rows, render_markdown
from tools.runtime import Precision, Runtime

ACCURACY_LINE = re.compile(r"^Accuracy on (\w+) is (\d+\.\d\d)%$", re.MULTILINE)
SUMMARY_LINE = re.compile(r"^Summary: (\d+)/(\d+) ", re.MULTILINE)
# The nine classes as a prompt should name them (the WordNet synsets of in9_classes.txt), written out here.
FULL_NAMES = ["dog", "bird", "wheeled vehicle", "reptile", "carnivore", "insect", "musical instrument", "primate",
              "fish"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("clipdata") / "bg_challenge", per_class=2, seed=3).root


@pytest.fixture(scope="module")
def loaded(tiny_clip):
    return load_model(tiny_clip)


def same_random_clip():
    """The open_clip model the source builds for clip:TINY/none, text tower included."""
    import open_clip  # noqa: PLC0415
    with torch.random.fork_rng():
        torch.manual_seed(RANDOM_SEED)
        return open_clip.create_model(TINY_CLIP, pretrained=None).eval()


def run_script(script, argv, capsys):
    return run_in_process(script.main, argv, capsys)


def hand_head(model, tokenizer, names, templates, articles: bool) -> torch.Tensor:
    """The zero-shot head written out: per class, its prompts' text embeddings normalised, averaged and
    normalised again. articles: 'a' before a vowel made 'an', as the nine-prompt head writes them."""
    rows = []
    with torch.no_grad():
        for name in names:
            texts = [template(name) for template in templates]
            if articles:
                texts = [re.sub(r"\ba (?=[aeiou])", "an ", text) for text in texts]
            embeddings = model.encode_text(tokenizer(texts))
            mean = (embeddings / embeddings.norm(dim=-1, keepdim=True)).mean(dim=0)
            rows.append(mean / mean.norm())
    return torch.stack(rows)


def test_spec_parsing():
    assert parse_spec("ViT-B-32/openai") == ClipSpec("ViT-B-32", "openai", Head.IMAGENET, Templates.OPENAI)
    assert parse_spec("ViT-B-32/none") == ClipSpec("ViT-B-32", None)
    assert parse_spec("ViT-B-32") == ClipSpec("ViT-B-32", None)
    assert parse_spec("ViT-B-32//data/weights.pt") == ClipSpec("ViT-B-32", "/data/weights.pt")
    assert parse_spec("ViT-B-32/openai+head=in9") == ClipSpec("ViT-B-32", "openai", Head.IN9)
    assert parse_spec("ViT-B-32/openai+templates=simple+head=in9") == \
        parse_spec("ViT-B-32/openai+head=in9+templates=simple") == \
        ClipSpec("ViT-B-32", "openai", Head.IN9, Templates.SIMPLE)
    assert parse_spec("ViT-B-32+head=in9") == ClipSpec("ViT-B-32", None, Head.IN9)
    assert parse_spec("ViT-B-32//data/a+b.pt+head=imagenet") == ClipSpec("ViT-B-32", "/data/a+b.pt")
    with pytest.raises(UserError, match="names no architecture"):
        parse_spec("/openai")
    with pytest.raises(UserError, match=r"unknown head 'nine' in clip:ViT-B-32/openai\+head=nine; "
                                        r"valid: imagenet, in9"):
        parse_spec("ViT-B-32/openai+head=nine")
    with pytest.raises(UserError, match=r"unknown option 'heads' .*; valid: head, templates"):
        parse_spec("ViT-B-32/openai+heads=in9")
    with pytest.raises(UserError, match="head given twice"):
        parse_spec("ViT-B-32/openai+head=in9+head=imagenet")


def test_nine_prompts_name_the_classes_in_full_with_their_articles():
    nine = prompts(Head.IN9, Templates.OPENAI)
    assert len(nine) == 9 and all(len(p) == 80 for p in nine)
    assert "a photo of a wheeled vehicle." in nine[2] and "a photo of a vehicle." not in nine[2]
    assert "a photo of an insect." in nine[5] and "the embroidered insect." in nine[5]
    assert "a photo of a musical instrument." in nine[6] and "a photo of a instrument." not in nine[6]
    assert "an origami insect." in prompts(Head.IN9, Templates.SIMPLE)[5]
    for texts in (*nine, *prompts(Head.IN9, Templates.SIMPLE)):
        assert not any(re.search(r"\b[Aa] [aeiouAEIOU]", text) for text in texts), texts
    imagenet = prompts(Head.IMAGENET, Templates.OPENAI)  # open_clip's, verbatim: the standard classifier
    assert len(imagenet) == 1000 and all(len(p) == 80 for p in imagenet)
    assert imagenet[0][0] == "a bad photo of a tench." and "a photo of a goldfish." in imagenet[1]


@pytest.mark.slow
def test_default_head_is_the_1000_imagenet_class_names_by_hand(loaded, one_thread):
    import open_clip  # noqa: PLC0415
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES  # noqa: PLC0415
    model = same_random_clip()
    tokenizer = open_clip.get_tokenizer(TINY_CLIP)
    classifier = loaded.model.classifier
    for key, value in model.visual.state_dict().items():  # the same random model
        assert torch.equal(value, classifier.visual.state_dict()[key])
    expected = hand_head(model, tokenizer, IMAGENET_CLASSNAMES, template_sets()["simple"], articles=False)
    assert classifier.head.shape == (1000, 16)
    torch.testing.assert_close(classifier.head, expected, rtol=0, atol=1e-5)
    assert float(classifier.logit_scale) == pytest.approx(model.logit_scale.exp().item())
    assert loaded.num_classes == 1000 and loaded.arch == f"clip:{TINY_CLIP}" and loaded.weights == "none"
    zero_shot = loaded.describe()["zero_shot"]
    assert (zero_shot["head"], zero_shot["classes"], zero_shot["templates"], zero_shot["prompts"]) == \
        ("imagenet", 1000, "simple", 7000)


@pytest.mark.slow
def test_nine_prompt_head_by_hand(tiny_clip, one_thread):
    import open_clip  # noqa: PLC0415
    loaded = load_model(f"clip:{TINY_CLIP}/none+head=in9")  # CLIP's 80 templates: 720 prompts
    model = same_random_clip()
    expected = hand_head(model, open_clip.get_tokenizer(TINY_CLIP), FULL_NAMES, template_sets()["openai"],
                         articles=True)
    classifier = loaded.model.classifier
    assert classifier.head.shape == (9, 16) and loaded.num_classes == 9
    torch.testing.assert_close(classifier.head, expected, rtol=0, atol=1e-5)
    images = torch.randint(0, 256, (4, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        features = classifier.visual(F.interpolate((images.float() / 255 - loaded.model.mean) / loaded.model.std,
                                                   size=(32, 32), mode="bicubic", antialias=True))
        by_hand = model.logit_scale.exp() * F.normalize(features, dim=-1) @ expected.T
        torch.testing.assert_close(loaded.model(images), by_hand, rtol=1e-5, atol=1e-5)
    zero_shot = loaded.describe()["zero_shot"]
    assert (zero_shot["head"], zero_shot["classes"], zero_shot["templates"], zero_shot["prompts"]) == \
        ("in9", 9, "openai", 720)


@pytest.mark.slow
def test_head_and_templates_are_part_of_the_model_identity(tiny_clip, tmp_path, one_thread):
    """Resume states and the zoo key a model by its SHA-256: one weights file under two heads (or two template
    sets) is two models."""
    weights = tmp_path / "tiny.pt"
    torch.save(same_random_clip().state_dict(), weights)
    digests = {}
    for options in ("+templates=simple", "+head=in9+templates=simple", "+head=in9"):
        loaded = load_model(f"clip:{TINY_CLIP}/{weights}{options}")
        digests[options] = loaded.identity
        assert loaded.describe()["zero_shot"]["weights_sha256"] == sha256_file(weights)
        assert loaded.source == str(weights)
    assert len(set(digests.values())) == 3
    assert load_model(f"clip:{TINY_CLIP}/{weights}+head=in9").identity == digests["+head=in9"]


@pytest.mark.parametrize("change", ["pooling", "version"])
def test_open_clips_model_config_and_version_are_part_of_the_model_identity(change, tiny_clip, tmp_path, monkeypatch,
                                                                            one_thread):
    """One weights file under another open_clip configuration of its architecture (the image tower's pooling,
    which changes every image embedding, no weight and not the text head), or read by another open_clip: another
    model."""
    import open_clip  # noqa: PLC0415
    weights = tmp_path / "tiny.pt"
    torch.save(same_random_clip().state_dict(), weights)
    spec = f"clip:{TINY_CLIP}/{weights}+head=in9+templates=simple"
    with files_read() as read:
        first = load_model(spec)
    assert unrecorded_reads(read, first.record) == []
    if change == "pooling":
        if "pool_type" not in {field.name for field in dataclasses.fields(open_clip.model.CLIPVisionCfg)}:
            pytest.skip(f"open_clip {open_clip.__version__} has no pool_type")
        config = open_clip.get_model_config(TINY_CLIP)
        config["vision_cfg"]["pool_type"] = "avg"
        monkeypatch.setitem(open_clip.factory._MODEL_CONFIGS, TINY_CLIP, config)
    else:
        monkeypatch.setattr(open_clip, "__version__", "99.0.0", raising=False)
    again = load_model(spec)
    assert again.identity != first.identity
    settings = again.record.describe()
    if change == "pooling":
        assert settings["settings"]["open_clip model config"]["vision_cfg"]["pool_type"] == "avg"
        images = torch.randint(0, 256, (4, 3, 224, 224), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            assert not torch.allclose(again.model(images), first.model(images))
    else:
        assert settings["libraries"]["open_clip"] == "99.0.0"


@pytest.mark.slow
def test_text_head_is_cached_by_content(tiny_clip, tmp_path, monkeypatch, caplog, one_thread):
    cache = DecodedCache(tmp_path / "cache")  # the run's (--cache-dir)
    builds = []
    build = clip_zero_shot.zero_shot_head
    monkeypatch.setattr(clip_zero_shot, "zero_shot_head", lambda *a, **k: builds.append(1) or build(*a, **k))
    model = same_random_clip()
    weights = tmp_path / "tiny.pt"
    torch.save(model.state_dict(), weights)
    spec = f"clip:{TINY_CLIP}/{weights}+head=in9"
    first = load_model(spec, cache=cache)
    assert len(builds) == 1 and list((tmp_path / "cache").rglob("*.npy"))
    # a head encoded on a GPU differs from the CPU's in the last bits: each device model has its own entry
    assert [json.loads(m.read_text())["device"] for m in (tmp_path / "cache").rglob("meta.json")] == \
        [clip_zero_shot.device_model(torch.device("cpu"))]
    [meta] = (tmp_path / "cache").rglob("meta.json")
    os.utime(meta, (time.time() - 3 * 24 * 3600,) * 2)  # last used three days ago
    again = load_model(spec, cache=cache)  # read from the cache: the same head, no text encoded
    assert len(builds) == 1 and torch.equal(again.model.classifier.head, first.model.classifier.head)
    assert time.time() - meta.stat().st_mtime < 60  # marked as used today, for `python -m tools.data cache`
    assert again.identity == first.identity
    load_model(spec + "+templates=simple", cache=cache)  # other prompts: another head
    assert len(builds) == 2
    with torch.no_grad():  # the same file name, other text weights: built again, and different
        model.text_projection.mul_(-1)
    torch.save(model.state_dict(), weights)
    changed = load_model(spec, cache=cache)
    assert len(builds) == 3
    torch.testing.assert_close(changed.model.classifier.head, -first.model.classifier.head)
    assert changed.identity != first.identity
    for entry in (tmp_path / "cache").rglob("head.npy"):  # a damaged entry is built again, with a warning
        entry.write_bytes(b"not an array")
    with caplog.at_level(logging.WARNING):
        assert torch.equal(load_model(spec, cache=cache).model.classifier.head, changed.model.classifier.head)
    assert len(builds) == 4 and "unreadable cache" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_head_is_built_on_the_runtimes_gpu_in_true_fp32(tiny_clip, loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # not the CPU's head from the cache
    builds = []
    build = clip_zero_shot.zero_shot_head
    monkeypatch.setattr(clip_zero_shot, "zero_shot_head", lambda *a, **k: builds.append(a[3]) or build(*a, **k))
    on_gpu = load_model(tiny_clip, runtime=Runtime(torch.device("cuda"), Precision.TF32))
    assert [device.type for device in builds] == ["cuda"]
    assert {t.device.type for t in on_gpu.model.state_dict().values()} == {"cpu"}
    torch.testing.assert_close(on_gpu.model.classifier.head, loaded.model.classifier.head, rtol=0, atol=1e-5)
    assert torch.backends.cuda.matmul.allow_tf32  # the runtime's setting, back after the fp32 head


@pytest.mark.slow
def test_the_default_head_goes_through_the_imagenet_map(tiny_clip, loaded, data, tmp_path, capsys, one_thread):
    """Per image: the argmax over the 1000 class names, then the ImageNet->IN-9 map, as for any 1000-class
    model; an argmax outside the nine groups (-1) is wrong. Both the library's predictions and the script's
    printed accuracies against the brute-force reference."""
    code, out, err = run_script(in9_eval, ["--data-path", str(data), "--arch", tiny_clip, "--eval-dataset", "all",
                                           "--device", "cpu", "--no-progress", "--output-dir", str(tmp_path)], capsys)
    assert code == 0, err
    printed = dict(ACCURACY_LINE.findall(out))
    run = run_in9(loaded, Runtime(torch.device("cpu")), list_in9_files(data, VARIATIONS, 2),
                  In9Config(VARIATIONS, 16, 2, progress=False))
    statistics = (loaded.model.mean.flatten().tolist(), loaded.model.std.flatten().tolist())
    unmapped = 0
    for variation in VARIATIONS:
        reference = reference_evaluate(loaded.model.classifier, data, variation, 1000, statistics)
        assert run.results[variation].predictions.tolist() == reference.predictions
        assert printed[variation] == f"{reference.accuracy:.2f}"
        unmapped += reference.predictions.count(-1)
    assert unmapped > 0  # some images' argmax is one of the 630 ImageNet classes outside IN-9: counted wrong
    assert run.provenance["num_classes"] == 1000 and run.provenance["zero_shot"]["head"] == "imagenet"


def test_logits_are_scaled_cosines_with_clip_statistics_and_resizing(loaded, one_thread):
    import open_clip  # noqa: PLC0415
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


@pytest.mark.slow
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
    ("clip:ViT-B-32/openai", {"weights": "IMAGENET1K_V1"}, "drop --weights IMAGENET1K_V1"),
])
def test_bad_clip_specs(tiny_clip, arch, kwargs, message):
    with pytest.raises(UserError, match=message):
        load_model(arch, **kwargs)


def test_a_bad_clip_option_is_one_error_line(tiny_clip, data, capsys):
    code, out, err = run_script(in9_eval, ["--data-path", str(data), "--arch", f"clip:{TINY_CLIP}/none+templates=80",
                                           "--device", "cpu"], capsys)
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == (f"error: unknown templates '80' in clip:{TINY_CLIP}/none+templates=80; "
                                            f"valid: openai, simple")


def test_leaderboard_says_what_each_row_predicts_over(loaded, tiny_clip):
    """Each row's class count, and for CLIP its head and templates, from the provenance; the page says what
    they mean."""
    nine = load_model(f"clip:{TINY_CLIP}/none+head=in9{TINY_CLIP_OPTIONS}")

    def payload(model: str, description: dict) -> dict:
        provenance = {**description, "data": {"sha256": "d" * 64}}
        in9 = {"original": {"accuracy": 50.0}, "mixed_same": {"accuracy": 40.0}, "mixed_rand": {"accuracy": 30.0},
               "bg_gap": 10.0, "provenance": provenance}
        return {"model": model, "source": "clip", "weights": "none", "in9": in9,
                "challenge": {"challenge_accuracy": 5.0, "criterion": "any", "provenance": provenance}}

    plain = {k: v for k, v in loaded.describe().items() if k != "zero_shot"}
    rows = [measured_row(payload("default", loaded.describe())), measured_row(payload("nine", nine.describe())),
            measured_row(payload("in9-trained", {**plain, "num_classes": 9}))]
    assert [(r.classes, r.zero_shot) for r in rows] == [(1000, "imagenet, simple templates"),
                                                      (9, "in9, simple templates"), (9, None)]
    published = {r.model: r.classes for r in published_rows()}
    assert published["ResNet-50"] == 1000 and published["ResNet-50 (IN-9L)"] == 9
    page = render_markdown(rows)
    assert "| default | clip | none | – | 1000 (CLIP imagenet, simple templates) |" in page
    assert "| nine | clip | none | – | 9 (CLIP in9, simple templates) |" in page
    assert "| in9-trained | clip | none | – | 9 |" in page
    assert "not comparable with the 1000-class rows" in page and "nine prompts" in page
    only_1000 = render_markdown([rows[0]])
    assert "not comparable with the 1000-class rows" not in only_1000


@pytest.mark.slow
def test_random_initialisation_is_reproducible(tiny_clip, loaded, one_thread):
    again = load_model(tiny_clip)
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again.model(images), loaded.model(images))
    assert again.identity == loaded.identity and np.isfinite(float(loaded.model.classifier.logit_scale))


@pytest.fixture(scope="module")
def tiny_coca(tmp_path_factory):
    """A tiny CoCa architecture (open_clip's CoCa class: its image tower returns (pooled, tokens))."""
    import open_clip  # noqa: PLC0415
    config = {"embed_dim": 16, "custom_text": True,
              "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16,
                             "attentional_pool": True, "attn_pooler_heads": 2, "output_tokens": True},
              "text_cfg": {"context_length": 76, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1,
                           "embed_cls": True, "output_tokens": True},
              "multimodal_cfg": {"context_length": 76, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    path = tmp_path_factory.mktemp("coca") / "tiny-coca.json"
    path.write_text(json.dumps(config))
    open_clip.add_model_config(path)
    return "tiny-coca"


def test_a_coca_model_scores_its_pooled_image_embedding(tiny_coca, one_thread):
    """CoCa's image tower returns (pooled embedding, tokens): the classifier scores the pooled one, as
    open_clip's encode_image does."""
    import open_clip  # noqa: PLC0415
    loaded = load_model(f"clip:{tiny_coca}/none+head=in9+templates=simple")
    with torch.random.fork_rng():
        torch.manual_seed(RANDOM_SEED)
        model = open_clip.create_model(tiny_coca, pretrained=None).eval()
    assert isinstance(model, open_clip.CoCa)
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    preprocess = open_clip.get_model_preprocess_cfg(model)
    x = (images.float() / 255 - torch.tensor(preprocess["mean"]).view(1, 3, 1, 1)) / \
        torch.tensor(preprocess["std"]).view(1, 3, 1, 1)
    x = F.interpolate(x, size=(32, 32), mode="bicubic", antialias=True)
    with torch.no_grad():
        expected = model.logit_scale.exp() * model.encode_image(x, normalize=True) @ loaded.model.classifier.head.T
        got = loaded.model(images)
    assert got.shape == (2, 9)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def with_preprocess(monkeypatch, **settings):
    """open_clip's create_model as a pretrained tag with these preprocess settings makes it (the tag's
    pretrained config merged into the model's `preprocess_cfg`, as open_clip does for e.g. MobileCLIP)."""
    import open_clip  # noqa: PLC0415
    create = open_clip.create_model

    def created(*args, **kwargs):
        model = create(*args, **kwargs)
        open_clip.set_model_preprocess_cfg(model, {**open_clip.get_model_preprocess_cfg(model), **settings})
        return model
    monkeypatch.setattr(open_clip, "create_model", created)


@pytest.mark.slow
def test_the_tags_interpolation_and_preprocessing_are_used_and_in_the_identity(tiny_clip, loaded, monkeypatch,
                                                                               one_thread):
    """A tag whose config says bilinear (MobileCLIP, CLIPA, PE) is resized bilinearly, and its preprocess
    settings are in the model's identity and provenance."""
    import open_clip  # noqa: PLC0415
    assert loaded.describe()["zero_shot"]["preprocess"]["interpolation"] == "bicubic"
    with_preprocess(monkeypatch, interpolation="bilinear")
    bilinear = load_model(tiny_clip)
    assert bilinear.describe()["zero_shot"]["preprocess"]["interpolation"] == "bilinear"
    assert bilinear.identity != loaded.identity
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    model = same_random_clip()
    preprocess = open_clip.get_model_preprocess_cfg(model)
    x = (images.float() / 255 - torch.tensor(preprocess["mean"]).view(1, 3, 1, 1)) / \
        torch.tensor(preprocess["std"]).view(1, 3, 1, 1)
    with torch.no_grad():
        features = model.encode_image(F.interpolate(x, size=(32, 32), mode="bilinear", antialias=True),
                                      normalize=True)
        expected = model.logit_scale.exp() * features @ bilinear.model.classifier.head.T
        got = bilinear.model(images)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, loaded.model(images).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_the_head_cache_is_keyed_by_the_device_model(tiny_clip, tmp_path, monkeypatch, one_thread):
    """A head encoded on one GPU model may differ in its last bits from another's: the cache entry names the
    device model (for the CPU, its instruction set and torch's version), so another device builds its own."""
    cache = DecodedCache(tmp_path / "cache")
    builds = []
    build = clip_zero_shot.zero_shot_head
    monkeypatch.setattr(clip_zero_shot, "zero_shot_head", lambda *a, **k: builds.append(1) or build(*a, **k))
    spec = f"{tiny_clip}+head=in9"
    load_model(spec, cache=cache)
    (meta,) = [json.loads(m.read_text()) for m in (tmp_path / "cache").rglob("meta.json")]
    assert meta["device"] == clip_zero_shot.device_model(torch.device("cpu")) and torch.__version__ in meta["device"]
    monkeypatch.setattr(clip_zero_shot, "device_model", lambda device: "NVIDIA H100 80GB HBM3 (sm_90)")
    load_model(spec, cache=cache)
    assert len(builds) == 2  # another device model: not the first entry
    load_model(spec, cache=cache)
    assert len(builds) == 2


class _Unsafe:
    def __reduce__(self):
        return print, ("unpickled",)


def _safetensors_past_its_end(path):
    """A safetensors file whose header places a tensor past the file's end."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))


@pytest.mark.parametrize("damage", ["needs unpickling", "empty", "text", "safetensors past its end"])
def test_a_clip_weights_file_that_cannot_be_read_is_one_error_line(damage, tiny_clip, tmp_path):
    """A local CLIP weights file is read by open_clip (weights-only or safetensors): what it cannot read is one line
    naming the file, as a --checkpoint is (tracebacks before: UnpicklingError, EOFError, KeyError, SafetensorError)."""
    weights = tmp_path / ("tiny.safetensors" if "safetensors" in damage else "tiny.pt")
    if damage == "needs unpickling":
        torch.save({"w": _Unsafe()}, weights)
    elif damage == "empty":
        weights.write_bytes(b"")
    elif damage == "text":
        weights.write_text("weights")
    else:
        _safetensors_past_its_end(weights)
    with pytest.raises(UserError) as caught:
        load_model(f"clip:{TINY_CLIP}/{weights}{TINY_CLIP_OPTIONS}")
    assert str(weights) in str(caught.value) and "\n" not in str(caught.value)


def _save_word_tokenizer(folder, reverse: bool) -> None:
    """A Hugging Face tokenizer (one id per word of the nine-prompt head's prompts; with `reverse`, the ids in the
    other order) saved as a hub model's tokenizer files are, for an open_clip config whose text takes an HF
    tokenizer (as SigLIP's and 48 others of open_clip's do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    words = sorted({w for per_class in prompts(Head.IN9, Templates.SIMPLE) for t in per_class
                    for w in re.findall(r"\w+|[^\w\s]", t.lower())})
    words = words[::-1] if reverse else words
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]").save_pretrained(folder)


@pytest.fixture
def clip_with_hf_tokenizer(tmp_path):
    """A tiny open_clip architecture whose text config names a Hugging Face tokenizer (a local folder), its random
    weights' spec with the nine-prompt head, and the tokenizer's folder."""
    import open_clip  # noqa: PLC0415
    pytest.importorskip("transformers")
    folder = tmp_path / "tokenizer"
    _save_word_tokenizer(folder, reverse=False)
    config = {"embed_dim": 16,
              "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
              "text_cfg": {"context_length": 16, "vocab_size": 128, "width": 32, "heads": 2, "layers": 1,
                           "hf_tokenizer_name": str(folder)}}
    path = tmp_path / "bgc-tiny-hf-text.json"
    path.write_text(json.dumps(config))
    open_clip.add_model_config(path)
    return "clip:bgc-tiny-hf-text/none+head=in9+templates=simple", folder


def _tokenizes_through_batch_encode_plus() -> bool:
    """Whether the installed open_clip cuts text with a Hugging Face tokenizer through its batch_encode_plus (open_clip
    before 3.3), which transformers 5 removed."""
    import open_clip  # noqa: PLC0415
    return "batch_encode_plus" in open_clip.tokenizer.HFTokenizer.__call__.__code__.co_names


def _open_clip_2_24_call(self, texts, context_length=None):
    """open_clip 2.24's HFTokenizer.__call__ (to 3.2), as it cuts text."""
    texts = [texts] if isinstance(texts, str) else texts
    context_length = context_length or self.context_length
    texts = [self.clean_fn(text) for text in texts]
    return self.tokenizer.batch_encode_plus(texts, return_tensors="pt", max_length=context_length,
                                            padding="max_length", truncation=True).input_ids


def test_an_open_clip_that_tokenizes_with_what_transformers_removed_is_one_line(clip_with_hf_tokenizer,
                                                                                monkeypatch):
    """open_clip before 3.3 cuts text with a Hugging Face tokenizer through transformers' batch_encode_plus, which
    transformers 5 (the toolkit's floor) removed: a CLIP model with such a tokenizer is refused in one line that
    says to upgrade open_clip (an AttributeError traceback before, at the floor's open_clip 2.24). Where open_clip
    is newer, its 2.24 call is put in its place."""
    import open_clip  # noqa: PLC0415
    transformers = pytest.importorskip("transformers")
    if hasattr(transformers.PreTrainedTokenizerFast, "batch_encode_plus"):
        pytest.skip(f"transformers {transformers.__version__} has batch_encode_plus")
    if not _tokenizes_through_batch_encode_plus():
        monkeypatch.setattr(open_clip.tokenizer.HFTokenizer, "__call__", _open_clip_2_24_call)
    spec, _ = clip_with_hf_tokenizer
    with pytest.raises(UserError, match="batch_encode_plus") as refused:
        load_model(spec)
    assert "open_clip" in str(refused.value) and "3.3" in str(refused.value) and "\n" not in str(refused.value)


def test_the_tokenizer_is_part_of_the_identity_and_of_the_head_caches_key(clip_with_hf_tokenizer, tmp_path,
                                                                          one_thread):
    """The text head is made of the prompts as the tokenizer cuts them: a Hugging Face tokenizer's files (read from
    its hub's cache, where a moved refs/main gives others) and its library are inputs of the model. Another
    tokenizer under the same configuration builds another head, and another identity; before, the head cached with
    the first tokenizer was served, under the first identity."""
    import open_clip  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    if _tokenizes_through_batch_encode_plus() and not hasattr(PreTrainedTokenizerFast, "batch_encode_plus"):
        pytest.skip(f"open_clip {open_clip.version.__version__} tokenizes through batch_encode_plus, which this "
                    f"transformers removed (refused in one line: the test before)")
    cache = DecodedCache(tmp_path / "cache")
    spec, folder = clip_with_hf_tokenizer
    first = load_model(spec, cache=cache)
    _save_word_tokenizer(folder, reverse=True)
    again = load_model(spec, cache=cache)
    assert again.identity != first.identity
    assert not torch.equal(again.model.classifier.head, first.model.classifier.head)
    assert load_model(spec, cache=cache).identity == again.identity  # the second head, from the cache
    record = again.record.describe()
    tokenizer = record["settings"]["tokenizer"]
    assert tokenizer["context_length"] == 16 and tokenizer["class"] == "open_clip.tokenizer.HFTokenizer"
    assert tokenizer["hugging face"]["pipeline sha256"] != first.record.describe()["settings"]["tokenizer"][
        "hugging face"]["pipeline sha256"]
    assert {"transformers", "tokenizers"} <= set(record["libraries"])


@pytest.mark.parametrize("where", ["--cache-dir", "--no-cache", "benchmark"])
@pytest.mark.slow
def test_the_head_is_cached_where_the_run_caches_and_said(where, tiny_clip, data, tmp_path, monkeypatch, capsys,
                                                         caplog, one_thread):
    """A CLIP text head goes into the run's cache (--cache-dir), and with --no-cache nowhere, as the decoded data;
    a run that wrote one says so, where and how much, in the one line about the cache (the Python API too, in its
    own words). Before, every head went into the default cache folder, whatever the flags said, unannounced."""
    from tools import benchmark  # noqa: PLC0415
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "default"))
    spec = f"{tiny_clip}+head=in9"
    if where == "benchmark":
        with caplog.at_level(logging.INFO):
            benchmark(spec, data, device="cpu", batch_size=8, workers=1, progress=False, challenge=False,
                      variations=["original"], cache_dir=tmp_path / "chosen")
        err = caplog.text
    else:
        flags = ["--cache-dir", str(tmp_path / "chosen")] if where == "--cache-dir" else ["--no-cache"]
        code, out, err = run_script(in9_eval, ["--data-path", str(data), "--arch", spec, "--device", "cpu",
                                               "--no-progress", "--output-dir", str(tmp_path / "out"), *flags], capsys)
        assert code == 0, err
    assert not (tmp_path / "default").exists()
    heads = list((tmp_path / "chosen" / clip_zero_shot.HEAD_CACHE_FOLDER).glob("*/head.npy"))
    assert len(heads) == (0 if where == "--no-cache" else 1)
    said = [line for line in err.splitlines() if "cached:" in line]
    if where == "--no-cache":
        assert not said
    else:
        assert len(said) == 1 and str(tmp_path / "chosen" / clip_zero_shot.HEAD_CACHE_FOLDER) in said[0]
        assert ("cache=False" if where == "benchmark" else "--no-cache") in said[0]
