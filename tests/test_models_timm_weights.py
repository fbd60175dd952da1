"""timm pretrained weights whose files are in the Hugging Face cache but fail to load (a damaged safetensors
file, a config timm rejects) are one line naming that cause and the cached file, never "not in the cache";
weights that are not cached still say so."""

from __future__ import annotations

import json

import pytest

from tests.test_models_hub import put_in_cache, seeded
from tools.errors import UserError
from tools.models.sources import load_model

NAME, TAG = "test_vit", "r160_in1k"
REPO = f"timm/{NAME}.{TAG}"


@pytest.fixture
def files(tmp_path):
    timm = pytest.importorskip("timm")
    if NAME not in timm.list_models():
        pytest.skip(f"timm {timm.__version__} has no {NAME}")
    module = seeded(timm.create_model(NAME, pretrained=False), 1)
    config = {"architecture": NAME, "num_classes": 1000, "pretrained_cfg": {**module.pretrained_cfg, "hf_hub_id": REPO}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "damaged.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header" + bytes(64))
    return tmp_path


def refusal(name: str) -> str:
    with pytest.raises(UserError) as error:
        load_model(name)
    line = str(error.value)
    assert "\n" not in line and len(line) < 800, line
    return line


@pytest.mark.parametrize("name", [f"timm:{NAME}.{TAG}", f"timm:hf-hub:{REPO}"])
def test_a_damaged_cached_weights_file_is_named_as_the_cause(name, files, hub_cache):
    snapshot = put_in_cache(hub_cache, REPO, {"model.safetensors": files / "damaged.safetensors",
                                              "config.json": files / "config.json"})
    line = refusal(name)
    assert "not in the Hugging Face cache" not in line and str(snapshot) in line, line
    assert "delete" in line


def test_a_cached_config_timm_rejects_is_named_as_the_cause(files, hub_cache):
    config = json.loads((files / "config.json").read_text())
    (files / "odd.json").write_text(json.dumps({**config, "architecture": "no_such_architecture"}))
    put_in_cache(hub_cache, "bgc-test/odd", {"model.safetensors": files / "damaged.safetensors",
                                             "config.json": files / "odd.json"})
    line = refusal("timm:hf-hub:bgc-test/odd")
    assert "not in the Hugging Face cache" not in line and "no_such_architecture" in line, line


def test_weights_that_are_not_cached_still_say_so(files, hub_cache):
    assert "not in the Hugging Face cache" in refusal(f"timm:{NAME}.{TAG}")
    assert "not in the Hugging Face cache" in refusal("timm:hf-hub:bgc-test/absent")
