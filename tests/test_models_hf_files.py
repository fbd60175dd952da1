"""An `hf:` folder's files are believed only as far as they hold: every file its JSON names (the shards a weight map
lists, the module an auto_map names) stays inside the model's folder (a hub snapshot's links to ../../blobs/ are
the cache's own), a safetensors file whose header misdescribes its bytes, and remote code (trusted) whose class is
not there, end in one `error:` line. The hub cache is built as huggingface_hub builds it (blobs and links)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from tests.helpers import files_read, unrecorded_reads
from tests.test_models_hub import TIMM_REPO, put_in_cache, save_vit, timm_weights  # noqa: F401 (a fixture)
from tools.errors import UserError
from tools.models.record import ModelRecord
from tools.models.sources import load_model

safetensors_torch = pytest.importorskip("safetensors.torch")


def shard(folder: Path, outside: Path | None = None, name: str = "model-00002-of-00002.safetensors") -> dict:
    """Split the folder's model.safetensors into two shards and an index naming them (the second shard written to
    `outside` instead where given, and named by `name`): what save_pretrained writes for a large model."""
    state = safetensors_torch.load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(state)
    first, second = keys[:len(keys) // 2], keys[len(keys) // 2:]
    safetensors_torch.save_file({k: state[k] for k in first}, folder / "model-00001-of-00002.safetensors",
                                metadata={"format": "pt"})
    target = outside if outside is not None else folder / name
    target.parent.mkdir(parents=True, exist_ok=True)
    safetensors_torch.save_file({k: state[k] for k in second}, target, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**{k: "model-00001-of-00002.safetensors" for k in first},
                                            **{k: name for k in second}}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return state


def logits(loaded) -> torch.Tensor:
    images = torch.randint(0, 256, (2, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return loaded.model(images)


def test_a_sharded_model_in_the_hub_cache_loads(tmp_path, hub_cache):
    """The legitimate case the containment check must keep: shards in a snapshot, each a link to ../../blobs/."""
    save_vit(tmp_path / "vit", None, seed=4, num_labels=9)
    whole = load_model(f"hf:{tmp_path / 'vit'}")
    shard(tmp_path / "vit")
    snapshot = put_in_cache(hub_cache, "someone/sharded-vit", {p.name: p for p in (tmp_path / "vit").iterdir()})
    assert (snapshot / "model-00002-of-00002.safetensors").is_symlink()
    loaded = load_model("hf:someone/sharded-vit")
    assert torch.equal(logits(loaded), logits(whole))


def test_a_folders_identity_is_the_same_wherever_it_lies(tmp_path, hub_cache):
    """An `hf:` model is recorded by its files' content, not by where they lie or the name they are read by: the
    same folder copied elsewhere, or in the hub cache under a repository's name, is the same model (before, its
    path or name was in the record's `arch` setting), another folder's content another."""
    save_vit(tmp_path / "here", None, seed=4, num_labels=9)
    shutil.copytree(tmp_path / "here", tmp_path / "there")
    put_in_cache(hub_cache, "someone/vit", {p.name: p for p in (tmp_path / "here").iterdir()})
    save_vit(tmp_path / "other", None, seed=5, num_labels=9)
    here, there, other = (load_model(f"hf:{tmp_path / name}") for name in ("here", "there", "other"))
    assert here.identity == there.identity == load_model("hf:someone/vit").identity != other.identity
    assert str(tmp_path) not in json.dumps(here.record.settings)
    transformers = pytest.importorskip("transformers")
    records = []
    for name in ("here", "there"):  # the module itself, given to benchmark(): its name_or_path says where it was read
        record = ModelRecord()
        record.code(transformers.ViTForImageClassification.from_pretrained(tmp_path / name))
        records.append(record.digest)
    assert records[0] == records[1]


def test_an_adapter_transformers_puts_on_a_folders_model_is_in_its_identity(tmp_path):
    """A folder that holds a peft adapter beside its model (adapter_config.json, adapter_model.safetensors):
    transformers puts the adapter on the model it loads, so the adapter's files and peft are inputs of the model.
    Two folders of one base with other adapters predict otherwise: other identities, every file read recorded
    (before, the adapter was read unrecorded and, with the folder's path out of the identity, the second folder
    was the first one's model)."""
    peft = pytest.importorskip("peft")
    base = save_vit(tmp_path / "here", None, seed=4, num_labels=9)
    shutil.copytree(tmp_path / "here", tmp_path / "other")
    for name, seed in (("here", 1), ("other", 2)):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        wrapped = peft.get_peft_model(base, config)
        wrapped.save_pretrained(tmp_path / name)
        base = wrapped.unload()
    if importlib.util.find_spec("peft.utils.transformers_weight_conversion") is None:
        # transformers 5 puts a folder's adapter on with a module older peft (0.14 at the floor) lacks: one line
        with pytest.raises(UserError, match="peft") as refused:
            load_model(f"hf:{tmp_path / 'here'}")
        assert "\n" not in str(refused.value)
        return
    loaded = {}
    for name in ("here", "other"):
        with files_read() as read:
            loaded[name] = load_model(f"hf:{tmp_path / name}")
        assert unrecorded_reads(read, loaded[name].record) == []
    assert not torch.equal(logits(loaded["here"]), logits(loaded["other"]))
    assert loaded["here"].identity != loaded["other"].identity


@pytest.mark.parametrize("craft", ["prompt tuning", "linked out"])
def test_an_adapter_in_a_folder_is_checked_as_an_adapter_folder_is(craft, tmp_path):
    """The adapter transformers would put on a folder's model is held to the rules of an adapter folder given with
    @file: (its type LoRA or OFT, its files inside the folder), before transformers or peft read it: a prompt
    tuning config names a tokenizer that peft would load from anywhere."""
    pytest.importorskip("peft")
    save_vit(tmp_path / "vit", None, seed=4, num_labels=9)
    config = {"peft_type": "PROMPT_TUNING", "task_type": "SEQ_CLS", "num_virtual_tokens": 2,
              "tokenizer_name_or_path": str(tmp_path / "elsewhere")}
    if craft == "linked out":
        (tmp_path / "elsewhere.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                             "target_modules": ["query"]}))
        (tmp_path / "vit" / "adapter_config.json").symlink_to(tmp_path / "elsewhere.json")
    else:
        (tmp_path / "vit" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "vit" / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="LoRA and OFT" if craft == "prompt tuning" else "outside the adapter"):
        load_model(f"hf:{tmp_path / 'vit'}")


@pytest.mark.parametrize("where", ["local", "hub"])
def test_a_weight_map_naming_a_file_outside_the_folder_is_refused(where, tmp_path, hub_cache):
    save_vit(tmp_path / "vit", None, seed=4, num_labels=9)
    name = "../outside.safetensors" if where == "local" else "../../outside.safetensors"
    if where == "local":
        shard(tmp_path / "vit", tmp_path / "outside.safetensors", name)
        spec = f"hf:{tmp_path / 'vit'}"
    else:
        shard(tmp_path / "vit", tmp_path / "unused.safetensors", name)
        files = {p.name: p for p in (tmp_path / "vit").iterdir()}
        snapshot = put_in_cache(hub_cache, "someone/vit", files)
        shutil.copyfile(tmp_path / "unused.safetensors", snapshot / name)  # the file, there, inside the cache
        spec = "hf:someone/vit"
    with pytest.raises(UserError, match=r"names '\.\./.*outside\.safetensors', a file outside the model's folder"):
        load_model(spec)


def test_a_shard_linking_outside_the_folder_is_refused(tmp_path, hub_cache):
    save_vit(tmp_path / "vit", None, seed=4, num_labels=9)
    shard(tmp_path / "vit", tmp_path / "elsewhere" / "weights.safetensors")
    (tmp_path / "vit" / "model-00002-of-00002.safetensors").symlink_to(tmp_path / "elsewhere" / "weights.safetensors")
    with pytest.raises(UserError, match="a file outside the model's folder"):
        load_model(f"hf:{tmp_path / 'vit'}")


def test_a_single_weights_file_linking_outside_the_folder_is_refused(tmp_path, hub_cache):
    """As a shard: the one weights file of a local folder, a link to a file elsewhere, was read without a word."""
    save_vit(tmp_path / "vit", None, seed=4, num_labels=9)
    weights = tmp_path / "vit" / "model.safetensors"
    (tmp_path / "elsewhere").mkdir()
    weights.rename(tmp_path / "elsewhere" / "weights.safetensors")
    weights.symlink_to(tmp_path / "elsewhere" / "weights.safetensors")
    with pytest.raises(UserError, match="a file outside the model's folder"):
        load_model(f"hf:{tmp_path / 'vit'}")


def rewrite_header(path: Path, damage: str) -> None:
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header, body = json.loads(raw[8:8 + size]), raw[8 + size:]
    key = next(k for k in header if k != "__metadata__")
    if damage == "header length":
        path.write_bytes(struct.pack("<Q", 10**12) + raw[8:])
        return
    if damage == "offset beyond the file":
        header[key]["data_offsets"][1] += 10**9
    elif damage == "shape not its bytes":
        header[key]["shape"] = [10**6, *header[key]["shape"][1:]]
    elif damage == "truncated":
        body = body[:len(body) // 2]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + body)


@pytest.mark.parametrize("damage", ["offset beyond the file", "shape not its bytes", "truncated", "header length"])
def test_a_safetensors_header_that_lies_is_one_line(damage, tmp_path, hub_cache):
    save_vit(tmp_path / "vit", None, seed=4, num_labels=9)
    rewrite_header(tmp_path / "vit" / "model.safetensors", damage)
    with pytest.raises(UserError, match="cannot load hf:") as error:
        load_model(f"hf:{tmp_path / 'vit'}")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("reference, says", [
    ("modeling_custom.Missing", "does not load: module .* has no attribute 'Missing'"),
    ("../../elsewhere.Model", "auto_map names '../../elsewhere.Model', not a module of the model's folder"),
    ("/tmp/elsewhere.Model", "not a module of the model's folder"),
])
def test_trusted_remote_code_that_is_not_there_is_one_line(reference, says, tmp_path, hub_cache):
    save_vit(tmp_path / "vit", None, seed=4, num_labels=9)
    (tmp_path / "vit" / "modeling_custom.py").write_text("ANSWER = 42\n")
    config = json.loads((tmp_path / "vit" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForImageClassification": reference}
    (tmp_path / "vit" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=says) as error:
        load_model(f"hf:{tmp_path / 'vit'}", trust_remote_code=True)
    assert "\n" not in str(error.value)


def test_a_timm_hub_config_naming_a_weights_file_elsewhere_is_not_followed(timm_weights, hub_cache, tmp_path):  # noqa: F811
    """timm loads a hub model's weights from its repository whatever `file` its config.json names; the toolkit
    hashes and records that same file, and reads nothing the config points to outside the cache."""
    module, folder = timm_weights
    config = json.loads((folder / "config.json").read_text())
    elsewhere = tmp_path / "elsewhere" / "notes.txt"
    elsewhere.parent.mkdir()
    elsewhere.write_text("not the model's")
    config["pretrained_cfg"]["file"] = str(elsewhere)
    (tmp_path / "config.json").write_text(json.dumps(config))
    snapshot = put_in_cache(hub_cache, TIMM_REPO, {"model.safetensors": folder / "model.safetensors",
                                                    "config.json": tmp_path / "config.json"})
    loaded = load_model(f"timm:hf-hub:{TIMM_REPO}")
    assert loaded.source == str(snapshot / "model.safetensors")


def save_timm_wrapper(folder: Path, **changes) -> None:
    """transformers' wrapper of timm's tiny test_resnet as save_pretrained writes it, its 9 labels where the toolkit
    reads them (id2label), and `changes` made to its config.json."""
    transformers = pytest.importorskip("transformers")
    timm = pytest.importorskip("timm")
    if "test_resnet" not in timm.list_models():
        pytest.skip(f"timm {timm.__version__} has no test_resnet")
    model = transformers.TimmWrapperForImageClassification(
        transformers.TimmWrapperConfig(architecture="test_resnet", num_labels=9))
    model.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update({"id2label": {str(i): f"LABEL_{i}" for i in range(9)}, **changes})
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("change", ["checkpoint_path", "local-dir"])
def test_a_timm_wrapper_config_naming_files_elsewhere_is_refused(change, tmp_path):
    """transformers builds a wrapped timm model with timm.create_model(architecture, **model_args): a config whose
    model_args name weights (checkpoint_path) or whose architecture is a folder (`local-dir:`) or a Hub repository
    (`hf-hub:`) had timm read them, anywhere; refused in one line, reading nothing there. The plain model loads."""
    save_timm_wrapper(tmp_path / "plain")
    assert load_model(f"hf:{tmp_path / 'plain'}").num_classes == 9
    elsewhere = tmp_path / "elsewhere"
    save_timm_wrapper(elsewhere)
    torch.save(safetensors_torch.load_file(elsewhere / "model.safetensors"), elsewhere / "weights.pth")
    changes = ({"model_args": {"checkpoint_path": str(elsewhere / "weights.pth")}} if change == "checkpoint_path"
               else {"architecture": f"local-dir:{elsewhere}"})
    save_timm_wrapper(tmp_path / "crafted", **changes)
    with files_read() as read, pytest.raises(UserError, match="config.json") as refused:
        load_model(f"hf:{tmp_path / 'crafted'}")
    assert "\n" not in str(refused.value)
    assert [path for path in read if path.is_relative_to(elsewhere)] == []
