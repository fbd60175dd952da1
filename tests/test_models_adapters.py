"""Models as people save them: peft adapter folders on a base model and raw state dicts of peft-wrapped models,
merged on load (their predictions equal the peft model's own); a whole pickled module with --trust-checkpoint,
used as it is; PyTorch's tutorial layout (`model_state_dict`). Loading stays as strict and as safe as before."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import in9_eval
from tests.helpers import check_error, files_read, run_in_process, unrecorded_reads
from tools import zoo
from tools.data import synthetic
from tools.errors import UserError
from tools.in9 import IN9_MEAN, IN9_STD
from tools.models.adapters import OFT_UNRECORDED_SETTINGS, PEFT_READS_DEPRECATED
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.models.sources import load_model

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

LORA_TARGETS = ["features.0", "features.2", "features.6"]
OFT_TARGETS = ["features.6"]  # a 1x1 convolution: peft merges OFT on larger kernels inconsistently in some versions
ALPHA = 6


def small_cnn(seed: int = 0) -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return SmallCNN(9).eval()


def adapted(kind: str, seed: int = 0, head: bool = True) -> nn.Module:
    """A peft-wrapped SmallCNN whose adapters (and head, when it is saved with them) are random, so that they
    change the predictions; the base is `small_cnn(seed)`."""
    modules_to_save = ["fc"] if head else None
    if kind == "lora":
        config = peft.LoraConfig(r=4, lora_alpha=ALPHA, target_modules=LORA_TARGETS, modules_to_save=modules_to_save)
    else:
        config = peft.OFTConfig(r=0, oft_block_size=4, target_modules=OFT_TARGETS, modules_to_save=modules_to_save)
    model = peft.get_peft_model(small_cnn(seed), config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name or "oft_" in name or "modules_to_save" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    return torch.randint(0, 256, (6, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))


def own_logits(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The peft model's own logits on the pixels, normalised by hand as the 9-class rule says."""
    x = pixels.float().div(255)
    mean, std = (torch.tensor(s).view(1, 3, 1, 1) for s in (IN9_MEAN, IN9_STD))
    with torch.inference_mode():
        return model((x - mean) / std)


def loaded_logits(loaded, pixels: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return loaded.model(pixels)


def assert_same_predictions(loaded, model, pixels, seed: int = 0):
    got, expected = loaded_logits(loaded, pixels), own_logits(model, pixels)
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4), (got - expected).abs().max()
    assert torch.equal(got.argmax(1), expected.argmax(1))
    assert not torch.allclose(expected, own_logits(small_cnn(seed), pixels), atol=1e-2)  # the adapters matter


def save_base(path, seed: int = 0):
    torch.save(small_cnn(seed).state_dict(), path)
    return path


# ----------------------------------------------------------------------------------------------------------
# Adapter folders (save_pretrained)

@pytest.mark.parametrize("kind", ["lora", "oft"])
@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "bin"])
def test_an_adapter_folder_on_a_base_checkpoint_is_merged(kind, safe, pixels, tmp_path):
    model = adapted(kind)
    model.save_pretrained(tmp_path / "adapter", safe_serialization=safe)
    base = save_base(tmp_path / "base.pt")
    with files_read() as read:
        loaded = load_model(f"{SMALL_CNN}@file:{base}", checkpoint=tmp_path / "adapter")
    assert unrecorded_reads(read, loaded.record) == []
    assert_same_predictions(loaded, model, pixels)
    assert loaded.num_classes == 9
    assert f"peft {kind} adapter" in loaded.checkpoint_format
    # the same model named in one spec (the zoo's form)
    again = load_model(f"{SMALL_CNN}@file:{base}@file:{tmp_path / 'adapter'}")
    assert torch.equal(loaded_logits(again, pixels), loaded_logits(loaded, pixels))
    assert again.identity == loaded.identity and len(loaded.identity) == 64
    files = loaded.record.describe()["files"]  # base and adapter, by content
    assert {role: entry["path"] for role, entry in files.items()} == {
        "checkpoint": str(base), "adapter config": str(tmp_path / "adapter" / "adapter_config.json"),
        "adapter weights": str(tmp_path / "adapter" / ("adapter_model.safetensors" if safe else "adapter_model.bin"))}


def test_the_identity_of_an_adapter_is_base_and_adapter(pixels, tmp_path):
    """Another adapter on the same base, or the same adapter on another base: another identity."""
    base, other_base = save_base(tmp_path / "base.pt"), save_base(tmp_path / "other.pt", seed=5)
    adapted("lora").save_pretrained(tmp_path / "a")
    adapted("lora", seed=3).save_pretrained(tmp_path / "b")
    digests = {load_model(f"{SMALL_CNN}@file:{b}", checkpoint=tmp_path / a).identity
               for b in (base, other_base) for a in ("a", "b")}
    assert len(digests) == 4


@pytest.mark.parametrize("linked", ["adapter_model.safetensors", "adapter_config.json"])
def test_an_adapter_file_linked_out_of_its_folder_is_refused_unread(linked, tmp_path):
    """An adapter's files are files of its folder (of its repository's, for a Hugging Face cache snapshot, whose
    files are links to ../../blobs): one linked elsewhere is refused before anything reads it, as a model's are."""
    adapted("lora").save_pretrained(tmp_path / "saved")
    base = save_base(tmp_path / "base.pt")
    folder, elsewhere = tmp_path / "adapter", tmp_path / "elsewhere"
    folder.mkdir(), elsewhere.mkdir()
    for file in (tmp_path / "saved").iterdir():
        target = elsewhere / file.name if file.name == linked else folder / file.name
        target.write_bytes(file.read_bytes())
    (folder / linked).symlink_to(elsewhere / linked)
    with files_read() as read, pytest.raises(UserError, match=r"links to .*outside the adapter's folder"):
        load_model(f"{SMALL_CNN}@file:{base}", checkpoint=folder)
    assert elsewhere / linked not in {Path(path).resolve() for path in read}
    snapshot = tmp_path / "hub" / "models--org--adapter" / "snapshots" / ("0" * 40)  # a cache snapshot: loaded
    snapshot.mkdir(parents=True), (tmp_path / "hub" / "models--org--adapter" / "blobs").mkdir()
    for file in (tmp_path / "saved").iterdir():
        blob = tmp_path / "hub" / "models--org--adapter" / "blobs" / file.name
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", file.name))
    loaded = load_model(f"{SMALL_CNN}@file:{base}", checkpoint=snapshot)
    assert loaded.identity == load_model(f"{SMALL_CNN}@file:{base}", checkpoint=tmp_path / "saved").identity


@pytest.mark.parametrize("named", ["snapshot, relative", "subfolder", "subfolder, relative"])
def test_an_adapter_in_a_hub_cache_snapshot_loads_however_it_is_named(named, tmp_path, monkeypatch):
    """An adapter in a Hugging Face cache snapshot loads named by a relative path ('.', from the snapshot), and from
    a subfolder of the snapshot (a repository of several adapters, peft's `subfolder`), whose files link to
    ../../../blobs: within its repository (before, both were refused as linked out of the folder)."""
    adapted("lora").save_pretrained(tmp_path / "saved")
    base = save_base(tmp_path / "base.pt")
    repository = tmp_path / "hub" / "models--org--adapters"
    snapshot = repository / "snapshots" / ("0" * 40)
    inside = "" if named.startswith("snapshot") else "lora"
    (snapshot / inside).mkdir(parents=True), (repository / "blobs").mkdir()
    for file in (tmp_path / "saved").iterdir():
        (repository / "blobs" / file.name).write_bytes(file.read_bytes())
        up = [".."] * (3 if inside else 2)
        (snapshot / inside / file.name).symlink_to(Path(*up, "blobs", file.name))
    folder = snapshot / inside
    if named.endswith("relative"):
        monkeypatch.chdir(snapshot)
        folder = Path(inside or ".")
    loaded = load_model(f"{SMALL_CNN}@file:{base}", checkpoint=folder)
    assert loaded.identity == load_model(f"{SMALL_CNN}@file:{base}", checkpoint=tmp_path / "saved").identity


def test_an_adapter_folder_needs_a_base(tmp_path):
    adapted("lora").save_pretrained(tmp_path / "adapter")
    with pytest.raises(UserError, match=r"peft adapter folder.* on a base model: .*ARCH@file:BASE"):
        load_model(f"file:{tmp_path / 'adapter'}")
    with pytest.raises(UserError, match=r"has no pretrained weights"):
        load_model(SMALL_CNN, checkpoint=tmp_path / "adapter")


def test_an_adapter_that_does_not_fit_its_base_is_named(tmp_path):
    adapted("lora").save_pretrained(tmp_path / "adapter")  # with its 9-class head
    torch.save(SmallCNN(1000).state_dict(), tmp_path / "imagenet.pt")  # a base of another class count
    with pytest.raises(UserError, match=r"adapter in .* does not fit its base model: .*fc"):
        load_model(f"{SMALL_CNN}@file:{tmp_path / 'imagenet.pt'}", checkpoint=tmp_path / "adapter")


def test_an_unsafe_adapter_pickle_is_refused(tmp_path):
    model = adapted("lora")
    model.save_pretrained(tmp_path / "adapter", safe_serialization=False)
    weights = tmp_path / "adapter" / "adapter_model.bin"
    torch.save({"weights": torch.load(weights, weights_only=True), "module": nn.ReLU()}, weights)
    with pytest.raises(UserError, match=r"blocked globals: .*ReLU.*--trust-checkpoint"):
        load_model(f"{SMALL_CNN}@file:{save_base(tmp_path / 'base.pt')}", checkpoint=tmp_path / "adapter")


# ----------------------------------------------------------------------------------------------------------
# Raw state dicts of peft-wrapped models (torch.save(model.state_dict()))

@pytest.mark.parametrize("head", [True, False], ids=["head-saved", "head-plain"])
@pytest.mark.parametrize("kind", ["lora", "oft"])
def test_a_peft_state_dict_is_merged(kind, head, pixels, tmp_path):
    model = adapted(kind, head=head)
    path = tmp_path / "peft_state.pt"
    torch.save(model.state_dict(), path)
    alpha = {"lora_alpha": ALPHA} if kind == "lora" else {}
    loaded = load_model(SMALL_CNN, checkpoint=path, **alpha)
    assert_same_predictions(loaded, model, pixels)
    assert f"peft {kind}" in loaded.checkpoint_format


def test_a_lora_state_dict_with_another_alpha_computes_another_model(pixels, tmp_path):
    """Another alpha (or rsLoRA's scaling) on the same file: other logits, so another identity, each recorded."""
    model = adapted("lora")
    torch.save(model.state_dict(), tmp_path / "peft_state.pt")
    loaded = load_model(SMALL_CNN, checkpoint=tmp_path / "peft_state.pt", lora_alpha=2 * ALPHA)
    assert not torch.allclose(loaded_logits(loaded, pixels), own_logits(model, pixels), atol=1e-3)
    scalings = [{"lora_alpha": 4}, {"lora_alpha": 16}, {"lora_alpha": 16, "lora_rslora": True}]
    models = [load_model(SMALL_CNN, checkpoint=tmp_path / "peft_state.pt", **scaling) for scaling in scalings]
    assert len({m.identity for m in models}) == len(scalings)
    for scaling, m in zip(scalings, models):
        settings = m.record.describe()["settings"]
        assert (settings["lora_alpha"], settings["lora_rslora"]) == (scaling["lora_alpha"],
                                                                    scaling.get("lora_rslora", False))


@pytest.mark.slow
def test_a_lora_state_dict_without_its_alpha_is_one_line_that_says_what_to_pass(dataset, tmp_path, capsys):
    model = adapted("lora")
    path = tmp_path / "peft_state.pt"
    torch.save({"model_state_dict": model.state_dict(), "epoch": 2}, path)
    code, out, err = run_in_process(in9_eval.main, ["--data-path", str(dataset.root), "--arch", SMALL_CNN,
                                                    "--checkpoint", str(path), "--device", "cpu", "--no-progress",
                                                    "--output-dir", str(tmp_path / "out")], capsys)
    line = check_error(code, out, err, lines=None)
    assert "state dict of a peft-wrapped model" in line and "LoRA" in line
    assert "--lora-alpha" in line and "classifier keys" not in line
    # with its alpha, the numbers of the merged model
    merged = tmp_path / "merged.pt"
    torch.save(model.merge_and_unload().state_dict(), merged)
    results = {}
    for name, extra in (("peft", ["--checkpoint", str(path), "--lora-alpha", str(ALPHA)]),
                        ("merged", ["--checkpoint", str(merged)])):
        results[name] = tmp_path / f"{name}.json"
        code, out, err = run_in_process(in9_eval.main, ["--data-path", str(dataset.root), "--arch", SMALL_CNN, *extra,
                                                        "--device", "cpu", "--no-progress", "--results-file",
                                                        str(results[name]), "--output-dir", str(tmp_path / name)],
                                        capsys)
        assert code == 0, err
    peft_run, merged_run = (json.loads(results[n].read_text()) for n in ("peft", "merged"))
    assert peft_run["original"] == merged_run["original"] and peft_run["bg_gap"] == merged_run["bg_gap"]


def test_lora_alpha_is_refused_where_there_is_no_lora_state_dict(tmp_path):
    path = save_base(tmp_path / "base.pt")
    with pytest.raises(UserError, match=r"--lora-alpha .* peft-wrapped"):
        load_model(SMALL_CNN, checkpoint=path, lora_alpha=8)


# ----------------------------------------------------------------------------------------------------------
# Checkpoints as people save them

def test_the_tutorial_layout_is_recognised(pixels, tmp_path):
    model = small_cnn(2)
    path = tmp_path / "tutorial.pt"
    torch.save({"epoch": 5, "model_state_dict": model.state_dict(),
                "optimizer_state_dict": torch.optim.SGD(model.parameters(), lr=0.1).state_dict(), "loss": 0.5}, path)
    loaded = load_model(SMALL_CNN, checkpoint=path)
    assert torch.equal(loaded_logits(loaded, pixels), own_logits(model, pixels))
    assert "model_state_dict" in loaded.checkpoint_format


class Unregistered(nn.Module):
    """A notebook's own architecture, which no registry knows."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2), nn.BatchNorm2d(4), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(4, 9)
        with torch.no_grad():
            self.body[1].running_mean.uniform_(-0.2, 0.2)

    def forward(self, x):
        return self.head(self.body(x))


def test_a_trusted_whole_module_is_used_as_it_is(pixels, tmp_path):
    with torch.random.fork_rng():
        torch.manual_seed(4)
        model = Unregistered().train()  # saved in training mode, as a notebook leaves it
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = tmp_path / "whole.pt"
    torch.save(model, path)
    loaded = load_model(checkpoint=path, trust=True)
    assert loaded.num_classes == 9
    assert torch.equal(loaded_logits(loaded, pixels), own_logits(model.eval(), pixels))
    # probing its class count changed none of its batch-norm statistics
    assert all(torch.equal(loaded.model.classifier.state_dict()[k], v) for k, v in before.items())
    assert "Unregistered" in loaded.checkpoint_format


def write_module_code(folder, sign: int) -> None:
    """A module file defining `Signed`, a linear head whose logits are multiplied by `sign` in its forward."""
    (folder / "signed_net.py").write_text(
        "from torch import nn\n\n\nclass Signed(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.pool = nn.AdaptiveAvgPool2d(1)\n        self.head = nn.Linear(3, 9)\n\n"
        f"    def forward(self, x):\n        return {sign} * self.head(self.pool(x).flatten(1))\n")


def test_a_trusted_modules_code_is_in_its_identity(pixels, tmp_path, monkeypatch):
    """A pickled module holds its weights but not its classes' code: the same file under changed code (in the
    class's own file) computes another model, and is another identity."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "signed_net", raising=False)  # imported here: gone afterwards
    write_module_code(tmp_path, 1)
    import signed_net  # noqa: PLC0415 (written just now)
    path = tmp_path / "whole.pt"
    torch.save(signed_net.Signed(), path)
    first = load_model(checkpoint=path, trust=True)
    write_module_code(tmp_path, -1)
    monkeypatch.delitem(sys.modules, "signed_net")  # a later run imports the code as it is now
    with files_read() as read:
        again = load_model(checkpoint=path, trust=True)
    assert unrecorded_reads(read, again.record) == [] and tmp_path / "signed_net.py" in read
    assert torch.equal(loaded_logits(again, pixels), -loaded_logits(first, pixels))
    assert again.identity != first.identity
    assert again.record.describe()["files"]["code signed_net"]["path"] == str(tmp_path / "signed_net.py")


def test_a_trusted_module_under_a_key_is_used_as_it_is(pixels, tmp_path):
    model = small_cnn(3)
    path = tmp_path / "under_model.pt"
    torch.save({"model": model, "epoch": 3}, path)
    loaded = load_model(checkpoint=path, trust=True)
    assert torch.equal(loaded_logits(loaded, pixels), own_logits(model, pixels))


def test_a_whole_module_without_trust_is_one_line_naming_the_flag(dataset, tmp_path, capsys):
    path = tmp_path / "whole.pt"
    torch.save(small_cnn(), path)
    code, out, err = run_in_process(in9_eval.main, ["--data-path", str(dataset.root), "--checkpoint", str(path),
                                                    "--device", "cpu", "--no-progress", "--output-dir",
                                                    str(tmp_path / "out")], capsys)
    line = check_error(code, out, err, lines=None)
    assert "blocked globals" in line and "--trust-checkpoint" in line


# ----------------------------------------------------------------------------------------------------------
# The zoo

def run_zoo(data, output, specs, capsys):
    return run_in_process(zoo.main, ["--data-path", str(data), "--models", ",".join(specs), "--output-dir",
                                     str(output), "--device", "cpu", "--no-progress", "--no-cache", "--no-leaderboard",
                                     "--batch-size", "8"], capsys)


@pytest.mark.slow
def test_the_zoo_takes_an_adapter_on_a_base(tmp_path, capsys, monkeypatch):
    data = synthetic.generate(tmp_path / "bg", per_class=1, seed=1).root
    model = adapted("lora")
    model.save_pretrained(tmp_path / "adapter")
    base = save_base(tmp_path / "base.pt")
    merged = tmp_path / "merged.pt"
    torch.save(model.merge_and_unload().state_dict(), merged)
    specs = [f"{SMALL_CNN}@file:{base}@file:{tmp_path / 'adapter'}", f"{SMALL_CNN}@file:{merged}"]
    code, out, err = run_zoo(data, tmp_path / "zoo", specs, capsys)
    assert code == 0, err
    results_before = [json.loads(zoo.results_path(tmp_path / "zoo", zoo.parse_model_spec(s)).read_text())
                      for s in specs]
    # done is done: the same base and adapter are skipped; an adapter rewritten in place is run again
    calls = []
    real = zoo.evaluate_model
    monkeypatch.setattr(zoo, "evaluate_model", lambda *a, **k: calls.append(a) or real(*a, **k))
    code, out, err = run_zoo(data, tmp_path / "zoo", specs[:1], capsys)
    assert (code, calls) == (0, []) and f"{specs[0]}: skipped: " in out, err
    adapted("lora", seed=7).save_pretrained(tmp_path / "adapter")
    code, out, err = run_zoo(data, tmp_path / "zoo", specs[:1], capsys)
    assert code == 0 and len(calls) == 1 and f"{specs[0]}: done: " in out, err
    adapter_run, merged_run = results_before
    for variation in ("original", "mixed_same", "mixed_rand", "only_fg"):
        assert adapter_run["in9"][variation]["per_class"] == merged_run["in9"][variation]["per_class"]
    assert adapter_run["in9"]["bg_gap"] == merged_run["in9"]["bg_gap"]
    assert adapter_run["challenge"]["challenge_accuracy"] == merged_run["challenge"]["challenge_accuracy"]
    assert "peft lora adapter" in adapter_run["in9"]["provenance"]["checkpoint_format"]


def test_an_adapter_without_peft_installed_is_one_line_naming_the_install(tmp_path, monkeypatch):
    adapted("lora").save_pretrained(tmp_path / "adapter")
    base = save_base(tmp_path / "base.pt")
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(UserError, match=r"adapter folder .* needs the peft package.*pip install peft"):
        load_model(f"{SMALL_CNN}@file:{base}", checkpoint=tmp_path / "adapter")


# ----------------------------------------------------------------------------------------------------------
# Review findings: rsLoRA, adapters on wrapped sources, suffix-named targets, OFT's settings, per-caller refusals

def test_an_rslora_state_dict_is_merged_with_its_flag(pixels, tmp_path):
    """rsLoRA scales by alpha / sqrt(r), not alpha / r: the file cannot say which, the flag does."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = peft.get_peft_model(small_cnn(), peft.LoraConfig(r=4, lora_alpha=ALPHA, use_rslora=True,
                                                                 target_modules=LORA_TARGETS))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    model.eval()
    torch.save(model.state_dict(), tmp_path / "rs.pt")
    loaded = load_model(SMALL_CNN, checkpoint=tmp_path / "rs.pt", lora_alpha=ALPHA, lora_rslora=True)
    assert_same_predictions(loaded, model, pixels)
    plain = load_model(SMALL_CNN, checkpoint=tmp_path / "rs.pt", lora_alpha=ALPHA)  # as plain LoRA: another model
    assert not torch.allclose(loaded_logits(plain, pixels), loaded_logits(loaded, pixels), atol=1e-3)


def test_the_lora_refusal_names_rslora_and_alpha_pattern(tmp_path):
    torch.save(adapted("lora").state_dict(), tmp_path / "peft_state.pt")
    with pytest.raises(UserError, match=r"--lora-alpha.*--lora-rslora.*save_pretrained.*alpha_pattern"):
        load_model(SMALL_CNN, checkpoint=tmp_path / "peft_state.pt")


def tiny_vit(folder, seed: int = 2):
    """A tiny ViT classifier with IN-9's labels and 32x32 inputs (so that the toolkit wraps it twice: the
    transformers output, and the resize), saved with save_pretrained with its image processor."""
    transformers = pytest.importorskip("transformers")
    from tools.in9 import class_names  # noqa: PLC0415
    labels = [name.title() for name in class_names()]
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=32, id2label=dict(enumerate(labels)),
                                    label2id={n: i for i, n in enumerate(labels)})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = transformers.ViTForImageClassification(config).eval()
    module.save_pretrained(folder)
    transformers.ViTImageProcessor(size={"height": 32, "width": 32}, image_mean=[0.5, 0.4, 0.3],
                                   image_std=[0.2, 0.25, 0.3]).save_pretrained(folder)
    return module


# The base an adapter folder records (adapter_config.json's base_model_name_or_path): none for a base built in
# memory, its folder for one loaded from disk, a Hub id for one loaded from the Hub. peft's key listing looks
# that base up (on the Hub unless it is a local folder) to see if the vocabulary grew: the loader must not.
RECORDED_BASES = {"in memory": None, "a folder": "folder", "the Hub": "google/vit-base-patch16-224"}


@pytest.mark.parametrize("recorded", RECORDED_BASES.values(), ids=RECORDED_BASES.keys())
def test_an_adapter_folder_on_a_transformers_classifier_is_merged(recorded, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = tiny_vit(tmp_path / "vit")
    if recorded == "folder":
        base = type(base).from_pretrained(tmp_path / "vit").eval()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", PEFT_READS_DEPRECATED, FutureWarning)
        model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                          modules_to_save=["classifier"]))
    if recorded not in (None, "folder"):  # what get_peft_model records for a base from_pretrained(hub id) gave
        model.peft_config["default"].base_model_name_or_path = recorded
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for name, param in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    # saved as online, where peft's look-up of the recorded base is answered (offline it warns, here, in the test)
    model.eval().save_pretrained(tmp_path / "adapter", save_embedding_layers=False)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert (written or None) == (str(tmp_path / "vit") if recorded == "folder" else recorded)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_model(f"hf:{tmp_path / 'vit'}", checkpoint=tmp_path / "adapter")
    assert not caught, [str(w.message) for w in caught]  # not even the libraries' deprecations reach the user
    batch = torch.randint(0, 256, (4, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    x = batch.float() / 255
    x = (x - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor([0.2, 0.25, 0.3]).view(1, 3, 1, 1)
    x = torch.nn.functional.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False, antialias=True)
    with torch.inference_mode():
        expected, got = model(pixel_values=x).logits, loaded.model(batch)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert "peft lora adapter" in loaded.checkpoint_format


def test_a_lora_state_dict_whose_targets_are_suffixes_of_other_modules_is_merged(tmp_path):
    """peft matches list entries by suffix: `conv1` would adapt every block's conv1 too; the targets the file
    names are matched whole."""
    from torchvision.models import resnet18  # noqa: PLC0415
    with torch.random.fork_rng():
        torch.manual_seed(0)
        base = resnet18(num_classes=9).eval()
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=ALPHA, target_modules=r"^(conv1|fc)$"))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=gen))
    model.eval()
    torch.save(model.state_dict(), tmp_path / "suffix.pt")
    loaded = load_model("resnet18", checkpoint=tmp_path / "suffix.pt", lora_alpha=ALPHA)
    batch = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(loaded_logits(loaded, batch), own_logits(model, batch), rtol=1e-4, atol=1e-4)


def test_an_oft_state_dict_says_the_settings_it_assumes(tmp_path, caplog):
    torch.save(adapted("oft").state_dict(), tmp_path / "oft.pt")
    with caplog.at_level("WARNING", logger="tools.models.adapters"):
        load_model(SMALL_CNN, checkpoint=tmp_path / "oft.pt")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    import peft  # noqa: PLC0415
    settings = [name for name in OFT_UNRECORDED_SETTINGS if hasattr(peft.OFTConfig(target_modules=["fc"]), name)]
    assert settings, "the installed peft's OFTConfig has none of the settings a state dict does not record"
    assert len(warned) == 1 and all(name in warned[0] for name in settings) and "save_pretrained" in warned[0], warned


def test_the_zoo_refuses_a_lora_state_dict_without_naming_flags_it_lacks(tmp_path, capsys):
    data = synthetic.generate(tmp_path / "bg", per_class=1, seed=1).root
    torch.save(adapted("lora").state_dict(), tmp_path / "peft_state.pt")
    code, out, err = run_zoo(data, tmp_path / "zoo", [f"{SMALL_CNN}@file:{tmp_path / 'peft_state.pt'}"], capsys)
    assert code != 0
    text = out + err
    assert "lora_alpha" in text and "save_pretrained" in text and "--lora-alpha" not in text, text


def test_benchmark_takes_a_lora_state_dicts_scaling(tmp_path, capsys):
    from tools import benchmark  # noqa: PLC0415
    data = synthetic.generate(tmp_path / "bg", per_class=1, seed=1).root
    model = adapted("lora")
    torch.save(model.state_dict(), tmp_path / "peft_state.pt")
    torch.save(model.merge_and_unload().state_dict(), tmp_path / "merged.pt")
    quick = {"device": "cpu", "batch_size": 8, "workers": 1, "progress": False, "cache": False, "challenge": False,
             "variations": ["original"]}
    with pytest.raises(UserError, match=r"lora_alpha=.*save_pretrained") as refused:
        benchmark(f"{SMALL_CNN}@file:{tmp_path / 'peft_state.pt'}", data, **quick)
    assert "--lora-alpha" not in str(refused.value)
    got = benchmark(f"{SMALL_CNN}@file:{tmp_path / 'peft_state.pt'}", data, lora_alpha=ALPHA, **quick)
    merged = benchmark(f"{SMALL_CNN}@file:{tmp_path / 'merged.pt'}", data, **quick)
    assert got.in9["original"]["per_class"] == merged.in9["original"]["per_class"]


# ----------------------------------------------------------------------------------------------------------
# Adapter configs that name files, repositories or modules elsewhere

def prompt_tuning(elsewhere: Path, marker: Path) -> dict:
    """A prompt-tuning adapter whose config has peft load a tokenizer from `elsewhere` with its code trusted (peft
    before 0.15 passed the config's tokenizer_kwargs on as they were): the tokenizer's module writes `marker`."""
    (elsewhere / "tokenization_evil.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (elsewhere / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}}))
    return {"peft_type": "PROMPT_TUNING", "task_type": None, "num_virtual_tokens": 2, "token_dim": 16,
            "num_transformer_submodules": 1, "prompt_tuning_init": "TEXT", "prompt_tuning_init_text": "a photo",
            "tokenizer_name_or_path": str(elsewhere), "tokenizer_kwargs": {"trust_remote_code": True},
            "inference_mode": False}


def mixture_of_adapters(elsewhere: Path, marker: Path) -> dict:
    """An XLoRA config, which has peft load every adapter it names, from any folder or hub repository."""
    adapted("lora").save_pretrained(elsewhere)
    return {"peft_type": "XLORA", "hidden_size": 16, "adapters": {"a": str(elsewhere)}}


def megatron_layers(elsewhere: Path, marker: Path) -> dict:
    """A LoRA config naming Megatron layers, for which peft imports the module its megatron_core names (any module
    before peft 0.17)."""
    (elsewhere / "evil_core.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["classifier"],
            "megatron_config": {"num_layers": 1}, "megatron_core": "evil_core"}


@pytest.mark.parametrize("craft", [prompt_tuning, mixture_of_adapters, megatron_layers])
def test_an_adapter_config_naming_things_elsewhere_is_refused_before_peft_reads_it(craft, tmp_path, monkeypatch):
    """An adapter folder holds weights to merge: a config that has peft import a module, load a tokenizer or other
    adapters (from another folder or the Hub) is refused in one line before peft builds anything, and nothing of
    the folder it names is read."""
    from tests.test_models_hub import save_vit  # noqa: PLC0415 (a transformers base, whose config peft reads)
    save_vit(tmp_path / "vit", None, seed=0, num_labels=9)
    config = json.loads((tmp_path / "vit" / "config.json").read_text())
    (tmp_path / "vit" / "config.json").write_text(json.dumps({**config, "vocab_size": 16}))  # prompt tuning's need
    elsewhere, marker = tmp_path / "elsewhere", tmp_path / "marker"
    elsewhere.mkdir()
    monkeypatch.syspath_prepend(str(elsewhere))  # a module there is importable, as one in the working folder is
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(craft(elsewhere, marker)))
    safetensors_torch = pytest.importorskip("safetensors.torch")
    safetensors_torch.save_file({"prompt_embeddings": torch.zeros(2, 16)}, folder / "adapter_model.safetensors")
    with files_read() as read, pytest.raises(UserError, match="adapter_config.json") as refused:
        load_model(f"hf:{tmp_path / 'vit'}@file:{folder}")
    assert "\n" not in str(refused.value)
    assert [path for path in read if path.is_relative_to(elsewhere)] == [] and not marker.exists()
