"""Shared fixtures: generated IN-9-shaped data and hand-built models, all in tmp_path (the helpers that are not
fixtures are in tests/helpers.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.helpers import TINY_CLIP, TINY_CLIP_OPTIONS, save_torchscript

# the session's hooks: nothing left in the checkout or the user's caches
from tests.tree_guard import pytest_configure, pytest_sessionfinish, pytest_sessionstart, pytest_unconfigure  # noqa: F401
from tools.data import synthetic


@pytest.fixture(autouse=True)
def logging_as_it_was():
    """The root logger's handlers and level after each test as before it: a command's main run in the test's process
    sets up logging to that test's captured stderr (closed once the test ends), where any later log line would
    fail ("--- Logging error ---" in another test's output)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small generated dataset (4 images per class) in the release's layout."""
    return synthetic.generate(tmp_path_factory.mktemp("data") / "bg_challenge", per_class=4, seed=1)


@pytest.fixture(scope="session")
def color_ts(tmp_path_factory):
    """TorchScript files of the hand-built colour model: {9: path, 1000: path}."""
    folder = tmp_path_factory.mktemp("models")
    paths = {}
    for n in (9, 1000):
        paths[n] = folder / f"color{n}.ts"
        save_torchscript(synthetic.ColorEvidenceModel(n), paths[n])
    return paths


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: these models are tiny, and on a busy machine extra threads only wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    """A tiny open_clip architecture registered under TINY_CLIP (32x32 images, so the 224x224 inputs are
    resized inside the model); the spec of its random initialisation, with the default head (the 1000
    ImageNet class names) over the simple templates. Skips without open_clip_torch."""
    open_clip = pytest.importorskip("open_clip")
    config = {"embed_dim": 16,
              "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
              "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1}}
    path = tmp_path_factory.mktemp("clip") / f"{TINY_CLIP}.json"
    path.write_text(json.dumps(config))
    open_clip.add_model_config(path)
    return f"clip:{TINY_CLIP}/none{TINY_CLIP_OPTIONS}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two images per class for training and two for testing, in one IN-9-style folder."""
    root = tmp_path_factory.mktemp("tiny") / "in9"
    synthetic.generate(root, per_class=2, seed=3, split="train")
    synthetic.generate(root, per_class=2, seed=4)
    return root


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, offline (HF_HOME and HF_HUB_OFFLINE, and huggingface_hub's
    constants, which it reads once on import)."""
    constants = pytest.importorskip("huggingface_hub.constants")
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return home / "hub"
