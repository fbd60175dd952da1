"""Models from the Hugging Face Hub, offline: `timm:NAME[.TAG]` and `timm:hf-hub:ORG/NAME` with their pretrained
weights from a hub cache built here (timm's own loading path finds them), and `hf:PATH` transformers image
classifiers saved with `save_pretrained`. Each source's logits and IN-9 predictions equal the module's own on
the same input (normalised with the model's statistics and resized to its input size by hand), the weights'
file and hash are in the provenance, and every refusal (no cached weights, wrong labels, remote code, unsafe
pickles, a missing extra) is one `error:` line."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import in9_eval
from tests.helpers import check_error, files_read, run_in_process, unrecorded_reads
from tools import zoo
from tools.data import synthetic
from tools.data.hashing import sha256_file
from tools.errors import UserError
from tools.in9 import PredictionMap, class_names
from tools.models.sources import load_model

TIMM_NAME, TIMM_TAG = "test_vit", "r160_in1k"  # timm's tiny test ViT: 160x160 inputs, mean/std 0.5
TIMM_REPO = f"timm/{TIMM_NAME}.{TIMM_TAG}"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return synthetic.generate(tmp_path_factory.mktemp("hubdata") / "bg_challenge", per_class=2, seed=5).root


def put_in_cache(hub_cache: Path, repo_id: str, files: dict[str, Path], commit: str | None = None) -> Path:
    """Files in the hub cache's own layout, as huggingface_hub's download of `repo_id`'s main branch at `commit`
    leaves them: each file's content once under blobs/ (named by its SHA-256 for LFS files such as weights, by its
    git blob hash otherwise), snapshots/COMMIT/NAME a relative symlink to it, and refs/main holding COMMIT. The
    snapshot folder."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = repo / "snapshots" / commit
    for folder in (repo / "refs", repo / "blobs", snapshot):
        folder.mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        content = source.read_bytes()
        lfs = name.endswith((".safetensors", ".bin", ".pth"))
        blob = (hashlib.sha256(content) if lfs else hashlib.sha1(b"blob %d\0" % len(content) + content)).hexdigest()
        (repo / "blobs" / blob).write_bytes(content)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def seeded(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """The module with every parameter drawn from a seeded normal distribution (so predictions vary)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module.eval()


def images(count: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (count, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def own_logits(module, batch: torch.Tensor, mean, std, size: int, mode: str = "bicubic") -> torch.Tensor:
    """The module's logits written out: pixels to [0,1], normalised, resized (antialiased) to its size."""
    x = batch.float() / 255
    x = (x - torch.tensor(mean).reshape(1, 3, 1, 1)) / torch.tensor(std).reshape(1, 3, 1, 1)
    if size != 224:
        x = F.interpolate(x, size=(size, size), mode=mode, align_corners=False, antialias=True)
    with torch.no_grad():
        out = module(x)
    return out.logits if hasattr(out, "logits") else out


def check_same_predictions(loaded, reference: torch.Tensor, batch: torch.Tensor) -> None:
    with torch.no_grad():
        logits = loaded.model(batch)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    mapping = PredictionMap(loaded.num_classes)
    assert torch.equal(mapping(logits), mapping(reference))


# ----------------------------------------------------------------------------------------------------------
# timm

def timm_with_test_model():
    """timm, skipping where it is not installed or lacks its tiny test ViT (added after timm 0.9.0)."""
    timm = pytest.importorskip("timm")
    if TIMM_NAME not in timm.list_models():
        pytest.skip(f"timm {timm.__version__} has no {TIMM_NAME}")
    return timm


def timm_loading_pretrained():
    """timm, skipping where it is too old for the toolkit to load its pretrained weights (SAFE_TIMM)."""
    timm = pytest.importorskip("timm")
    from tools.models.timm_weights import SAFE_TIMM  # noqa: PLC0415
    if tuple(int(p) for p in timm.__version__.split(".")[:3] if p.isdigit()) < SAFE_TIMM:
        pytest.skip(f"timm {timm.__version__} is refused for pretrained weights")
    return timm


@pytest.fixture(scope="module")
def timm_weights(tmp_path_factory):
    """(the tiny test ViT with seeded weights, its weights as model.safetensors and as a config.json)."""
    timm = timm_with_test_model()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder = tmp_path_factory.mktemp("timm")
    module = seeded(timm.create_model(TIMM_NAME, pretrained=False), 1)
    safetensors_torch.save_file(module.state_dict(), folder / "model.safetensors")
    config = {"architecture": TIMM_NAME, "num_classes": 1000,
              "pretrained_cfg": {**module.pretrained_cfg, "hf_hub_id": TIMM_REPO}}
    (folder / "config.json").write_text(json.dumps(config))
    return module, folder


@pytest.mark.parametrize("name", [f"timm:{TIMM_NAME}.{TIMM_TAG}", f"timm:{TIMM_NAME}", f"timm:hf-hub:{TIMM_REPO}"])
def test_timm_pretrained_weights_from_the_hub_cache(name, timm_weights, hub_cache, caplog):
    module, folder = timm_weights
    snapshot = put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors",
                                                    "config.json": folder / "config.json"})
    with caplog.at_level(logging.INFO, logger="tools"), files_read() as read:
        loaded = load_model(name)
    assert unrecorded_reads(read, loaded.record) == []  # a hub name's config.json (timm reads it) is recorded
    weights_file = snapshot / "model.safetensors"
    assert (loaded.weights, loaded.source) == (TIMM_TAG, str(weights_file))
    record = loaded.record.describe()  # the weights and the pixel pipeline
    assert record["files"]["weights"] == {"path": str(weights_file), "sha256": sha256_file(weights_file)}
    assert record["settings"]["timm data config"]["input_size"] == [3, 160, 160]
    assert loaded.num_classes == 1000 and "0.5" in loaded.normalization
    assert sum("resized" in r.getMessage() for r in caplog.records) == 1  # said once, when loading
    batch = images()
    check_same_predictions(loaded, own_logits(module, batch, (0.5,) * 3, (0.5,) * 3, 160), batch)
    with caplog.at_level(logging.INFO, logger="tools"):
        loaded.model(batch)
    assert sum("resized" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.slow
def test_timm_offline_without_cached_weights_is_one_line(hub_cache, data, capsys, tmp_path):
    timm_with_test_model()
    code, out, err = run_in_process(in9_eval.main, ["--arch", f"timm:{TIMM_NAME}.{TIMM_TAG}", "--data-path",
                                                    str(data), "--device", "cpu", "--no-progress", "--output-dir",
                                                    str(tmp_path / "out")], capsys)
    line = check_error(code, out, err, lines=None)
    assert str(hub_cache) in line and f"timm.create_model('{TIMM_NAME}.{TIMM_TAG}', pretrained=True)" in line



def test_a_timm_hub_architecture_not_in_the_cache_is_one_line(hub_cache, tmp_path):
    """`timm:hf-hub:ORG/NAME@file:PATH` builds the architecture from the repository's config.json: offline and not
    cached, one line naming the cache (a LocalEntryNotFoundError traceback before)."""
    timm_with_test_model()
    torch.save({"x": torch.zeros(1)}, tmp_path / "weights.pt")
    with pytest.raises(UserError) as error:
        load_model(f"timm:hf-hub:{TIMM_REPO}@file:{tmp_path / 'weights.pt'}")
    assert "\n" not in str(error.value) and str(hub_cache) in str(error.value)


def test_a_hub_architecture_a_checkpoint_records_is_built_from_the_cache_alone(timm_weights, hub_cache, tmp_path):
    """A checkpoint (here timm's train.py's, of `--model hf-hub:ORG/NAME`) that records a hub architecture is built
    from the repository's cached config.json; one not in the cache is not downloaded for a file's sake: one line
    says to name it with --arch, which fetches it."""
    module, folder = timm_weights
    path = tmp_path / "model_best.pth.tar"
    torch.save({"arch": f"hf-hub:{TIMM_REPO}", "state_dict": module.state_dict(), "version": 2,
                "args": argparse.Namespace(model=f"hf-hub:{TIMM_REPO}", num_classes=1000)}, path)
    with pytest.raises(UserError, match="--arch") as error:
        load_model(checkpoint=path)
    assert "\n" not in str(error.value)
    put_in_cache(hub_cache, TIMM_REPO, {"config.json": folder / "config.json"})
    batch = images(2)
    check_same_predictions(load_model(checkpoint=path), own_logits(module, batch, (0.5,) * 3, (0.5,) * 3, 160), batch)

def test_timm_weights_none_keeps_random_weights(hub_cache):
    timm_with_test_model()
    loaded = load_model(f"timm:{TIMM_NAME}", weights="none")
    assert loaded.weights == "none" and loaded.source is None and loaded.num_classes == 1000
    assert loaded.model(images(2)).shape == (2, 1000)


URL_ONLY_TAG = "gcvit_xxtiny.in1k"  # pretrained weights at a URL (torch's hub cache), not on the Hugging Face Hub


@pytest.fixture
def torch_cache(tmp_path, monkeypatch):
    """An empty torch hub cache (TORCH_HOME) in tmp_path; its checkpoints folder."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    folder.mkdir(parents=True)
    return folder


def test_timm_url_weights_are_never_unpickled_unsafely(hub_cache, torch_cache, tmp_path):
    """A pickle that runs code, where timm reads a URL tag's weights from torch's hub cache, is refused unrun."""
    timm = pytest.importorskip("timm")
    url = timm.models.get_pretrained_cfg(URL_ONLY_TAG).url
    marker = tmp_path / "pickle-ran"
    torch.save({"x": Exploit(str(marker))}, torch_cache / Path(url).name)
    with pytest.raises(UserError) as error:
        load_model(f"timm:{URL_ONLY_TAG}")
    assert "\n" not in str(error.value) and not marker.exists()


def test_timm_older_than_its_safe_loading_is_refused_for_pretrained_weights(hub_cache, torch_cache, monkeypatch):
    """timm before 1.0.26 unpickles some pretrained weights without weights_only: refused, naming the version;
    --weights none still builds the architecture."""
    timm = pytest.importorskip("timm")
    monkeypatch.setattr(timm, "__version__", "0.9.0")
    with pytest.raises(UserError, match=r"timm>=1\.0\.26") as error:
        load_model(f"timm:{URL_ONLY_TAG}")
    assert "\n" not in str(error.value)
    assert load_model("timm:gcvit_xxtiny", weights="none").num_classes == 1000


def test_timm_name_without_pretrained_weights_says_so(hub_cache, torch_cache):
    timm = timm_loading_pretrained()
    name = next(n for n in ("convnext_atto_rms", "test_byobnet") if n in timm.list_models()
                and not timm.list_pretrained(f"{n}*"))
    with pytest.raises(UserError, match="no pretrained weights") as error:
        load_model(f"timm:{name}")
    assert "Hugging Face" not in str(error.value) and "--weights none" in str(error.value)


def test_timm_url_weights_offline_name_torchs_cache(hub_cache, torch_cache, monkeypatch):
    """Weights at a URL that is unreachable: the line names torch's hub cache (TORCH_HOME), not Hugging Face's."""
    timm_loading_pretrained()
    monkeypatch.setattr(torch.hub, "download_url_to_file", _no_network)
    with pytest.raises(UserError) as error:
        load_model(f"timm:{URL_ONLY_TAG}")
    line = str(error.value)
    assert str(torch_cache) in line and "Hugging Face" not in line and "TORCH_HOME" in line
    assert f"timm.create_model('{URL_ONLY_TAG}', pretrained=True)" in line


def _no_network(*args, **kwargs):
    raise OSError("network is unreachable")


# ----------------------------------------------------------------------------------------------------------
# transformers

def imagenet_labels() -> list[str]:
    return pytest.importorskip("timm.data").ImageNetInfo().label_descriptions()


HF_MEAN, HF_STD, HF_SIZE = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), 32  # ViTImageProcessor resizes bilinearly


def save_vit(folder: Path, labels: list[str] | None, seed: int, num_labels: int | None = None) -> torch.nn.Module:
    """A tiny randomly initialised ViTForImageClassification (32x32 inputs) and its image processor, saved with
    save_pretrained; the labels its config names (None: transformers' placeholders)."""
    transformers = pytest.importorskip("transformers")
    kwargs = {"num_labels": num_labels} if labels is None else {"id2label": dict(enumerate(labels)),
                                                                "label2id": {n: i for i, n in enumerate(labels)}}
    config = transformers.ViTConfig(image_size=HF_SIZE, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, **kwargs)
    module = seeded(transformers.ViTForImageClassification(config), seed)
    module.save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": HF_SIZE, "width": HF_SIZE}, image_mean=list(HF_MEAN),
                                   image_std=list(HF_STD)).save_pretrained(folder)
    return module


@pytest.mark.parametrize("name", [f"{TIMM_NAME}.{TIMM_TAG}", TIMM_NAME])
def test_a_timm_name_with_a_checkpoint_file_takes_timms_data_config(name, timm_weights, tmp_path):
    """`timm:NAME.TAG@file:CKPT` is NAME.TAG with the file's weights: timm's data config for the tag gives its
    mean, std, input size (160 here, not 224) and interpolation, as `timm:NAME.TAG` does; `timm:NAME@file:CKPT`
    (and so a timm training checkpoint, which records a bare name) takes the default tag's, as `timm:NAME` does,
    not 224 pixels and the class-count rule."""
    module, _ = timm_weights
    path = tmp_path / "weights.pt"
    torch.save(module.state_dict(), path)
    loaded = load_model(f"timm:{name}@file:{path}")
    assert "0.5" in loaded.normalization and "timm" in loaded.normalization
    batch = images()
    check_same_predictions(loaded, own_logits(module, batch, (0.5,) * 3, (0.5,) * 3, 160), batch)


def test_a_timm_hub_name_with_a_checkpoint_file_takes_the_hubs_data_config(timm_weights, hub_cache, tmp_path):
    """`timm:hf-hub:ORG/NAME@file:CKPT` is the hub repository's model with the file's weights: the mean, std and
    input size of the hub's config.json (which timm builds it from), as `timm:hf-hub:ORG/NAME` takes them; that
    config.json is in its record, so another one under the same file is another model."""
    module, folder = timm_weights
    config = json.loads((folder / "config.json").read_text())
    config["pretrained_cfg"]["mean"] = [0.4, 0.5, 0.6]
    changed = tmp_path / "config.json"
    changed.write_text(json.dumps(config))
    snapshot = put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors",
                                                    "config.json": changed})
    path = tmp_path / "weights.pt"
    torch.save(module.state_dict(), path)
    with files_read() as read:
        loaded = load_model(f"timm:hf-hub:{TIMM_REPO}@file:{path}")
    assert unrecorded_reads(read, loaded.record) == []
    assert "0.4" in loaded.normalization
    batch = images()
    check_same_predictions(loaded, own_logits(module, batch, (0.4, 0.5, 0.6), (0.5,) * 3, 160), batch)
    record = loaded.record.describe()
    assert record["files"]["timm hub config.json"]["path"] == str(snapshot / "config.json")
    put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors",
                                        "config.json": folder / "config.json"}, commit="e" * 40)
    assert load_model(f"timm:hf-hub:{TIMM_REPO}@file:{path}").identity != loaded.identity


@pytest.mark.parametrize("name", [f"timm:{TIMM_NAME}.{TIMM_TAG}", f"timm:{TIMM_NAME}.{TIMM_TAG}@file:weights.pt"])
def test_a_config_json_timm_never_reads_stays_out_of_a_registered_names_identity(name, timm_weights, hub_cache,
                                                                                 tmp_path):
    """A registered name takes its data config from timm's registry, never from the hub repository's config.json:
    the cache gaining one later (another download of the repository) leaves the model as it was."""
    module, folder = timm_weights
    torch.save(module.state_dict(), tmp_path / "weights.pt")
    name = name.replace("weights.pt", str(tmp_path / "weights.pt"))
    snapshot = put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors"})
    first = load_model(name)
    put_in_cache(hub_cache, TIMM_REPO, {"config.json": folder / "config.json"})  # into the same snapshot
    assert (snapshot / "config.json").is_file()
    again = load_model(name)
    assert again.identity == first.identity
    assert not [role for role in again.record.describe()["files"] if "config" in role]


@pytest.mark.parametrize("setting", ["mean", "interpolation"])
def test_a_timm_models_identity_holds_its_pixel_pipeline(setting, timm_weights, hub_cache):
    """The same weights under a hub config with another mean (or interpolation) are another model."""
    module, folder = timm_weights
    put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors",
                                        "config.json": folder / "config.json"})
    first = load_model(f"timm:hf-hub:{TIMM_REPO}")
    config = json.loads((folder / "config.json").read_text())
    config["pretrained_cfg"][setting] = {"mean": [0.4, 0.5, 0.6], "interpolation": "bilinear"}[setting]
    changed = folder.parent / f"config-{setting}.json"
    changed.write_text(json.dumps(config))
    put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors", "config.json": changed},
                 commit="c" * 40)
    again = load_model(f"timm:hf-hub:{TIMM_REPO}")
    assert again.identity != first.identity


def test_a_transformers_models_identity_holds_its_resampling(tmp_path, hub_cache):
    """Bilinear and bicubic resizing give other predictions: the processor's `resample` is in the identity."""
    save_vit(tmp_path / "vit", [n.title() for n in class_names()], seed=6)
    first = load_model(f"hf:{tmp_path / 'vit'}")
    pytest.importorskip("transformers").ViTImageProcessor(
        size={"height": HF_SIZE, "width": HF_SIZE}, image_mean=list(HF_MEAN), image_std=list(HF_STD),
        resample=3).save_pretrained(tmp_path / "vit")
    assert load_model(f"hf:{tmp_path / 'vit'}").identity != first.identity


def test_stray_weights_files_beside_a_transformers_model_leave_its_identity(tmp_path, hub_cache):
    """Only the files the model loads are its weights: another *.safetensors in the folder changes nothing."""
    save_vit(tmp_path / "vit", [n.title() for n in class_names()], seed=6)
    first = load_model(f"hf:{tmp_path / 'vit'}")
    pytest.importorskip("safetensors.torch").save_file({"x": torch.zeros(2)}, tmp_path / "vit" / "a-stray.safetensors")
    again = load_model(f"hf:{tmp_path / 'vit'}")
    assert (again.identity, again.source) == (first.identity, first.source)


@pytest.mark.parametrize("labels", ["imagenet", "in9", "in9-placeholders"])
def test_transformers_classifier_equals_its_own_predictions(labels, tmp_path, hub_cache):
    names = {"imagenet": imagenet_labels, "in9": lambda: [n.title() for n in class_names()],
             "in9-placeholders": lambda: None}[labels]()
    module = save_vit(tmp_path / "vit", names, seed=2, num_labels=9)
    with files_read() as read:
        loaded = load_model(f"hf:{tmp_path / 'vit'}")
    assert unrecorded_reads(read, loaded.record) == []
    assert loaded.num_classes == (1000 if labels == "imagenet" else 9)
    assert loaded.source == str(tmp_path / "vit" / "model.safetensors")
    record = loaded.record.describe()  # weights and configs
    assert record["files"]["weights"]["sha256"] == sha256_file(tmp_path / "vit" / "model.safetensors")
    assert {"config.json", "preprocessor_config.json"} <= set(record["files"])
    batch = images(seed=1)
    check_same_predictions(loaded, own_logits(module, batch, HF_MEAN, HF_STD, HF_SIZE, "bilinear"), batch)


@pytest.mark.parametrize("labels, message", [
    ([f"class {i}" for i in range(5)], "5 labels"),
    ([f"class {i}" for i in range(1000)], "not ImageNet's"),
    (["dog", "cat", "vehicle", "reptile", "carnivore", "insect", "instrument", "primate", "fish"], "not IN-9's"),
])
def test_transformers_classifier_with_other_labels_is_refused(labels, message, tmp_path, data, hub_cache, capsys):
    save_vit(tmp_path / "vit", labels, seed=3)
    code, out, err = run_in_process(in9_eval.main, ["--arch", f"hf:{tmp_path / 'vit'}", "--data-path", str(data),
                                                    "--device", "cpu", "--no-progress", "--output-dir",
                                                    str(tmp_path / "out")], capsys)
    assert message in check_error(code, out, err, lines=None)


def test_transformers_model_needing_remote_code_is_refused(tmp_path, hub_cache):
    save_vit(tmp_path / "vit", None, seed=4, num_labels=9)
    marker = tmp_path / "remote-code-ran"
    (tmp_path / "vit" / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((tmp_path / "vit" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForImageClassification": "modeling_custom.CustomModel"}
    (tmp_path / "vit" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="remote code") as error:
        load_model(f"hf:{tmp_path / 'vit'}")
    assert "\n" not in str(error.value) and not marker.exists()


def test_transformers_pickled_weights_need_weights_only(tmp_path, hub_cache):
    """A pytorch_model.bin that needs more than weights_only unpickling is refused, and its code never runs."""
    save_vit(tmp_path / "vit", None, seed=5, num_labels=9)
    (tmp_path / "vit" / "model.safetensors").unlink()
    marker = tmp_path / "pickle-ran"
    torch.save({"x": Exploit(str(marker))}, tmp_path / "vit" / "pytorch_model.bin")
    with pytest.raises(UserError) as error:
        load_model(f"hf:{tmp_path / 'vit'}")
    assert "\n" not in str(error.value) and not marker.exists()


class Exploit:
    """A pickle whose loading would run code (here: make a file)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_transformers_hub_name_offline_without_cache_is_one_line(hub_cache, data, capsys, tmp_path):
    pytest.importorskip("transformers")
    code, out, err = run_in_process(in9_eval.main, ["--arch", "hf:someone/missing-vit", "--data-path", str(data),
                                                    "--device", "cpu", "--no-progress", "--output-dir",
                                                    str(tmp_path / "out")], capsys)
    line = check_error(code, out, err, lines=None)
    assert str(hub_cache) in line and "snapshot_download('someone/missing-vit')" in line


@pytest.mark.slow
def test_the_zoo_takes_a_transformers_folder(tmp_path, data, hub_cache, capsys, one_thread):
    save_vit(tmp_path / "vit", [n.title() for n in class_names()], seed=6)
    spec = f"hf:{tmp_path / 'vit'}"
    code, out, err = run_in_process(zoo.main, ["--data-path", str(data), "--models", spec, "--output-dir",
                                               str(tmp_path / "zoo"), "--device", "cpu", "--no-progress",
                                               "--no-cache"], capsys)
    assert code == 0, err
    payload = json.loads(zoo.results_path(tmp_path / "zoo", zoo.parse_model_spec(spec)).read_text())
    code, _, err = run_in_process(in9_eval.main, ["--arch", spec, "--data-path", str(data), "--device", "cpu",
                                                  "--no-progress", "--no-cache", "--eval-dataset", "all",
                                                  "--results-file", str(tmp_path / "in9.json"), "--output-dir",
                                                  str(tmp_path / "o")],
                                  capsys)
    assert code == 0, err
    assert payload["in9"] == json.loads((tmp_path / "in9.json").read_text())
    assert payload["source"] == "hf"


def test_a_missing_extra_is_one_line(monkeypatch, tmp_path):
    import sys  # noqa: PLC0415
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(UserError, match=r"pip install .*\[hf\]"):
        load_model(f"hf:{tmp_path}")



# ----------------------------------------------------------------------------------------------------------
# The zoo's "already done" for hub models

def zoo_outcome(spec: str, data: Path, output: Path, capsys) -> tuple[str, dict]:
    """The zoo's one line for `spec` ("... done: ..." or "... skipped: ...") and its results file."""
    code, out, err = run_in_process(zoo.main, ["--data-path", str(data), "--models", spec, "--output-dir", str(output),
                                               "--device", "cpu", "--no-progress", "--no-cache"], capsys)
    assert code == 0, err
    line = next(text for text in out.splitlines() if text.startswith(f"{spec}: "))
    return line, json.loads(zoo.results_path(output, zoo.parse_model_spec(spec)).read_text())


@pytest.mark.slow
def test_the_zoo_reruns_a_timm_model_when_the_hubs_main_moved(timm_weights, hub_cache, data, tmp_path, capsys,
                                                            one_thread):
    """A later download moved refs/main to another snapshot: the recorded file (the old snapshot's) is not what
    the model loads now, so the model runs again."""
    module, folder = timm_weights
    spec = f"timm:{TIMM_NAME}.{TIMM_TAG}"
    first = put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors",
                                                 "config.json": folder / "config.json"})
    line, payload = zoo_outcome(spec, data, tmp_path / "zoo", capsys)
    assert ": done:" in line and payload["weights_file"] == str(first / "model.safetensors")
    other = tmp_path / "other.safetensors"
    pytest.importorskip("safetensors.torch").save_file(seeded(module, 9).state_dict(), other)
    moved = put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": other, "config.json": folder / "config.json"},
                         commit="b" * 40)
    line, again = zoo_outcome(spec, data, tmp_path / "zoo", capsys)
    assert ": done:" in line and again["weights_file"] == str(moved / "model.safetensors")
    assert again["identity"]["model"] != payload["identity"]["model"]


@pytest.mark.slow
def test_the_zoo_reruns_a_transformers_model_whose_processor_changed(tmp_path, data, hub_cache, capsys, one_thread):
    """The image processor's mean/std are part of an hf: model's identity, beside its weights."""
    save_vit(tmp_path / "vit", [n.title() for n in class_names()], seed=6)
    spec = f"hf:{tmp_path / 'vit'}"
    line, first = zoo_outcome(spec, data, tmp_path / "zoo", capsys)
    assert ": done:" in line
    assert ": skipped:" in zoo_outcome(spec, data, tmp_path / "zoo", capsys)[0]
    pytest.importorskip("transformers").ViTImageProcessor(
        size={"height": HF_SIZE, "width": HF_SIZE}, image_mean=[0.485, 0.456, 0.406],
        image_std=[0.229, 0.224, 0.225]).save_pretrained(tmp_path / "vit")
    line, again = zoo_outcome(spec, data, tmp_path / "zoo", capsys)
    assert ": done:" in line and again["identity"]["model"] != first["identity"]["model"]


@pytest.mark.slow
def test_the_zoo_reruns_a_timm_file_whose_pixel_pipeline_changed(timm_weights, data, tmp_path, capsys, one_thread,
                                                                 monkeypatch):
    """`timm:NAME.TAG@file:CKPT`'s identity holds timm's data config and version beside the file: the file alone
    unchanged is not the same model once timm's version (which decides that config) is another."""
    import timm  # noqa: PLC0415 (timm_weights skips without it)

    module, _ = timm_weights
    path = tmp_path / "weights.pt"
    torch.save(module.state_dict(), path)
    spec = f"timm:{TIMM_NAME}.{TIMM_TAG}@file:{path}"
    assert ": done:" in zoo_outcome(spec, data, tmp_path / "zoo", capsys)[0]
    assert ": skipped:" in zoo_outcome(spec, data, tmp_path / "zoo", capsys)[0]
    monkeypatch.setattr(timm, "__version__", "99.0.0")
    assert ": done:" in zoo_outcome(spec, data, tmp_path / "zoo", capsys)[0]


@pytest.mark.slow
def test_the_zoo_skips_a_timm_model_whose_cache_gained_a_config_it_never_reads(timm_weights, hub_cache, data,
                                                                                tmp_path, capsys, one_thread):
    """The zoo's "already done" is the model's identity: a config.json timm does not read for a registered name,
    added to the cache after the run, neither reruns the model nor makes its saved state another's."""
    module, folder = timm_weights
    spec = f"timm:{TIMM_NAME}.{TIMM_TAG}"
    snapshot = put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors"})
    line, first = zoo_outcome(spec, data, tmp_path / "zoo", capsys)
    assert ": done:" in line
    put_in_cache(hub_cache, TIMM_REPO, {"config.json": folder / "config.json"})  # into the same snapshot
    assert (snapshot / "config.json").is_file()
    line, again = zoo_outcome(spec, data, tmp_path / "zoo", capsys)
    assert ": skipped:" in line and again == first


def test_a_timm_hub_models_identity_holds_its_config(timm_weights, hub_cache):
    """timm builds a hub model from its config.json (architecture, model_args): another config.json under the same
    weights and data config is another model."""
    module, folder = timm_weights
    put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors",
                                        "config.json": folder / "config.json"})
    first = load_model(f"timm:hf-hub:{TIMM_REPO}")
    config = json.loads((folder / "config.json").read_text())
    config["model_args"] = {**config.get("model_args", {}), "drop_rate": 0.25}  # no effect in eval, another file
    changed = folder.parent / "config-args.json"
    changed.write_text(json.dumps(config))
    put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors", "config.json": changed},
                 commit="d" * 40)
    assert load_model(f"timm:hf-hub:{TIMM_REPO}").identity != first.identity


def test_the_snapshot_revision_is_the_one_under_the_repository(tmp_path):
    """An HF_HOME that itself has a folder named snapshots does not hide the revision."""
    from tools.models import hub  # noqa: PLC0415

    path = Path("/data/snapshots/hub/models--org--name/snapshots/abc123/model.safetensors")
    assert hub.snapshot_revision(path) == "abc123"
