"""What a transformers classifier's image processor does to the pixels is what `hf:` does inside the model: the
loaded model on 224x224 uint8 images equals the module on its processor's output (normalisation or none, BGR
order, EfficientNet's include_top), in float32 whatever dtype the checkpoint was saved in; a missing processor
config is a warning naming what was used, a processor that cannot be loaded is one line, and code a model or
processor ships runs only with --trust-remote-code."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import in9_eval
from tests.helpers import check_error, files_read, run_in_process, unrecorded_reads
from tools.errors import UserError
from tools.in9 import class_names
from tools.models.sources import load_model

transformers = pytest.importorskip("transformers")


def save_resnet(folder: Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny ResNetForImageClassification with IN-9's labels and random weights, saved in `dtype`; the float32
    module."""
    labels = [n.title() for n in class_names()]
    config = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                       id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    torch.manual_seed(seed)
    module = transformers.ResNetForImageClassification(config).eval()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    module.to(dtype).save_pretrained(folder)
    return module.to(dtype).float().eval()


def images(count: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (count, 3, 224, 224), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def processors():
    """Tiny processors whose resizing and cropping leave 224x224 images as they are, by what they do to pixels."""
    return {
        "vit": lambda: transformers.ViTImageProcessor(size={"height": 224, "width": 224}, image_mean=[0.3, 0.5, 0.7],
                                                      image_std=[0.2, 0.3, 0.4]),
        "vit-no-normalize": lambda: transformers.ViTImageProcessor(size={"height": 224, "width": 224},
                                                                   do_normalize=False),
        "convnext": lambda: transformers.ConvNextImageProcessor(size={"shortest_edge": 224}, crop_pct=1.0),
        "mobilevit-bgr": lambda: transformers.MobileViTImageProcessor(size={"shortest_edge": 224},
                                                                      crop_size={"height": 224, "width": 224}),
        "efficientnet-include-top": lambda: transformers.EfficientNetImageProcessor(
            size={"height": 224, "width": 224}, crop_size={"height": 224, "width": 224}, include_top=True),
    }


@pytest.mark.parametrize("kind", list(processors()))
@pytest.mark.slow
def test_the_loaded_model_equals_the_module_on_its_processors_output(kind, tmp_path, hub_cache):
    module = save_resnet(tmp_path / "m")
    processor = processors()[kind]()
    processor.save_pretrained(tmp_path / "m")
    batch = images()
    pixels = processor(images=[np.ascontiguousarray(im.permute(1, 2, 0).numpy()) for im in batch],
                       return_tensors="pt")["pixel_values"]
    assert pixels.shape == (4, 3, 224, 224)
    loaded = load_model(f"hf:{tmp_path / 'm'}")
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), module(pixel_values=pixels).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoints_load_in_float32(dtype, tmp_path, hub_cache):
    module = save_resnet(tmp_path / "m", seed=1, dtype=dtype)
    transformers.ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(tmp_path / "m")
    loaded = load_model(f"hf:{tmp_path / 'm'}")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.float32}
    batch = images(seed=2)
    x = (batch.float() / 255 - 0.5) / 0.5
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(batch), module(pixel_values=x).logits, rtol=1e-4, atol=1e-4)


def test_no_processor_config_is_a_warning_naming_what_is_used(tmp_path, hub_cache, caplog):
    save_resnet(tmp_path / "m")
    with caplog.at_level(logging.INFO, logger="tools"):
        loaded = load_model(f"hf:{tmp_path / 'm'}")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "preprocessor_config.json" in warnings[0] and "class-count" in warnings[0]
    assert "in9" in loaded.normalization


@pytest.mark.slow
def test_a_processor_that_cannot_be_loaded_is_one_line(tmp_path, data, hub_cache, capsys):
    save_resnet(tmp_path / "m")
    (tmp_path / "m" / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "NoSuchImageProcessor", "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))
    code, out, err = run_in_process(in9_eval.main, ["--arch", f"hf:{tmp_path / 'm'}", "--data-path", str(data),
                                                    "--device", "cpu", "--no-progress", "--output-dir",
                                                    str(tmp_path / "out")], capsys)
    line = check_error(code, out, err, lines=None)
    assert "preprocessor_config.json" in line
    assert len(line) < 600, len(line)  # transformers' message lists every processor type it knows on its line


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tools.data import synthetic  # noqa: PLC0415
    return synthetic.generate(tmp_path_factory.mktemp("hfdata") / "bg_challenge", per_class=1, seed=7).root


def with_remote_processor(folder: Path, marker: Path) -> None:
    """The folder's processor config names code of its own (auto_map), which makes `marker` when it runs."""
    (folder / "custom_processing.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import ViTImageProcessor\n\n\nclass CustomProcessor(ViTImageProcessor):\n    pass\n")
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["auto_map"] = {"AutoImageProcessor": "custom_processing.CustomProcessor"}
    (folder / "preprocessor_config.json").write_text(json.dumps(config))


def test_remote_code_runs_only_with_the_opt_in_flag(tmp_path, data, hub_cache, capsys):
    save_resnet(tmp_path / "m")
    transformers.ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(tmp_path / "m")
    marker = tmp_path / "remote-code-ran"
    with_remote_processor(tmp_path / "m", marker)
    argv = ["--arch", f"hf:{tmp_path / 'm'}", "--data-path", str(data), "--device", "cpu", "--no-progress",
            "--output-dir", str(tmp_path / "out")]
    code, out, err = run_in_process(in9_eval.main, argv, capsys)
    assert "--trust-remote-code" in check_error(code, out, err, lines=None) and not marker.exists()
    loaded = load_model(f"hf:{tmp_path / 'm'}", trust_remote_code=True)
    assert marker.exists() and loaded.num_classes == 9


def test_a_model_needing_remote_code_names_the_flag(tmp_path, hub_cache):
    save_resnet(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["auto_map"] = {"AutoModelForImageClassification": "modeling_custom.CustomModel"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="--trust-remote-code"):
        load_model(f"hf:{tmp_path / 'm'}")


def with_remote_model(folder: Path, sign: float) -> None:
    """The folder's model is a class of its own code (auto_map): ResNet's logits times `sign`."""
    (folder / "modeling_custom.py").write_text(
        "from transformers import ResNetForImageClassification\n\n\n"
        "class CustomModel(ResNetForImageClassification):\n"
        "    def forward(self, pixel_values=None, **kwargs):\n"
        "        out = super().forward(pixel_values=pixel_values, **kwargs)\n"
        f"        out.logits = out.logits * {sign}\n"
        "        return out\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModelForImageClassification": "modeling_custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))


def test_a_models_remote_code_is_in_its_identity(tmp_path, hub_cache, monkeypatch):
    """The same weights and configs under changed code (--trust-remote-code): other predictions, another
    identity, and the code file named in the record."""
    monkeypatch.setattr(transformers.dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # transformers puts its modules folder there
    save_resnet(tmp_path / "m")
    transformers.ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(tmp_path / "m")
    with_remote_model(tmp_path / "m", 1.0)
    first = load_model(f"hf:{tmp_path / 'm'}", trust_remote_code=True)
    with_remote_model(tmp_path / "m", -1.0)
    with files_read() as read:
        again = load_model(f"hf:{tmp_path / 'm'}", trust_remote_code=True)
    assert unrecorded_reads(read, again.record) == []
    batch = images()
    with torch.no_grad():
        assert not torch.equal(first.model(batch).argmax(1), again.model(batch).argmax(1))
    assert again.identity != first.identity
    code = again.record.describe()["files"]["remote code"]
    assert [Path(path).name for path in code["paths"]] == ["modeling_custom.py"]


@pytest.mark.parametrize("damage", ["a list", "a label key that is no number", "labels that are a list"])
def test_a_malformed_config_is_one_line(damage, tmp_path, hub_cache):
    save_resnet(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    config = json.loads(path.read_text())
    if damage == "a list":
        config = [config]
    elif damage == "labels that are a list":
        config["id2label"] = list(config["id2label"].values())
    else:
        config["id2label"] = {("x" if k == "0" else k): v for k, v in config["id2label"].items()}
    path.write_text(json.dumps(config))
    with pytest.raises(UserError, match="config.json"):
        load_model(f"hf:{tmp_path / 'm'}")


def without_labels(config: dict, num_labels) -> None:
    config.pop("id2label"), config.pop("label2id")
    config["num_labels"] = num_labels


CONFIG_DAMAGE = {  # what a hand-edited config.json may hold, and a word the line says
    "num_labels a string": (lambda c: without_labels(c, "9"), "num_labels"),
    "num_labels a float": (lambda c: without_labels(c, 9.0), "num_labels"),
    "image_size a string": (lambda c: c.update(image_size="224"), "image_size"),
    "image_size a list of one": (lambda c: c.update(image_size=[160]), "image_size"),
    "an activation transformers lacks": (lambda c: c.update(hidden_act="no_such"), "KeyError"),
    "depths a string": (lambda c: c.update(depths="1,1"), "depths"),
    "a width of words": (lambda c: c.update(embedding_size="eight"), "embedding_size"),
    "widths that do not fit the weights": (lambda c: c.update(hidden_sizes=[8, 32]), "config.json"),
}


@pytest.mark.parametrize("damage", list(CONFIG_DAMAGE))
@pytest.mark.slow
def test_a_config_transformers_or_the_toolkit_rejects_is_one_line(damage, tmp_path, hub_cache):
    save_resnet(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    config = json.loads(path.read_text())
    change, word = CONFIG_DAMAGE[damage]
    change(config)
    path.write_text(json.dumps(config))
    with pytest.raises(UserError, match=word) as error:
        load_model(f"hf:{tmp_path / 'm'}")
    assert "\n" not in str(error.value)



@pytest.mark.parametrize("asked", ["kernels-community/flash-attn2", "flex_attention",
                                   {"": "sdpa", "vision_config": "kernels-community/flash-attn3"}])
def test_a_config_asking_for_other_attention_is_refused(asked, tmp_path, hub_cache):
    """The toolkit runs transformers' own eager or sdpa attention (torch's math backend under sdpa): a config.json
    asking for another (a library's kernel, a torch.compile'd one, or compiled code transformers would download
    from a Hub repository and load, with the kernels package installed) is refused in one line."""
    from tests.test_models_hub import save_vit  # noqa: PLC0415
    save_vit(tmp_path / "m", None, seed=0, num_labels=9)
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "attn_implementation": asked}))
    with pytest.raises(UserError, match="attn_implementation") as error:
        load_model(f"hf:{tmp_path / 'm'}")
    assert "\n" not in str(error.value)
    path.write_text(json.dumps({**json.loads(path.read_text()), "attn_implementation": "eager"}))
    assert load_model(f"hf:{tmp_path / 'm'}").num_classes == 9


def test_a_config_nested_deeper_than_json_goes_is_one_line(tmp_path, hub_cache):
    save_resnet(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    path.write_text(path.read_text().rstrip().rstrip("}") + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(UserError, match="config.json") as error:
        load_model(f"hf:{tmp_path / 'm'}")
    assert "\n" not in str(error.value)

def test_an_image_size_of_height_and_width_is_taken(tmp_path, hub_cache):
    module = save_resnet(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "image_size": [160, 192]}))
    loaded = load_model(f"hf:{tmp_path / 'm'}")
    assert loaded.model.classifier.size == (160, 192)
    assert loaded.model(images(1)).shape == (1, 9) and module is not None


@pytest.mark.parametrize("resample", ["bicubic", 2.5, [3], True])
def test_a_resample_that_is_no_pil_code_is_one_line(resample, tmp_path, hub_cache):
    save_resnet(tmp_path / "m")
    transformers.ViTImageProcessor(size={"height": 224, "width": 224}).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "preprocessor_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "resample": resample}))
    with pytest.raises(UserError) as error:
        load_model(f"hf:{tmp_path / 'm'}")
    assert "resample" in str(error.value) and "\n" not in str(error.value)
