"""Shared fixtures: generated IN-9-shaped data and hand-built models, all in tmp_path."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from tools.data import synthetic


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """A small generated dataset (4 images per class) in the release's layout."""
    return synthetic.generate(tmp_path_factory.mktemp("data") / "bg_challenge", per_class=4, seed=1)


def save_torchscript(model: torch.nn.Module, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.trace(model.eval(), torch.zeros(2, 3, 224, 224)), str(path))


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


def run_in_process(main, argv, capsys):
    """Run a command's `main(argv)` in this process; (exit code, stdout, stderr). Restores the logging setup."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        code = main(argv)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="session", autouse=True)
def private_cache_home(tmp_path_factory):
    """$XDG_CACHE_HOME in a temporary folder: the tests neither read nor fill the user's caches (the default
    decoded-data cache, CLIP's text heads)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache_home")))
        yield


TINY_CLIP = "bgc-tiny-clip"
TINY_CLIP_OPTIONS = "+templates=simple"  # 7 templates: the 1000-class head is 7000 prompts, not 80000


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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gloo_process(rank: int, world_size: int, port: int, function, args, results: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tests import collective_guard  # noqa: PLC0415
    collective_guard.install()
    try:
        result = function(*args)
    finally:
        from tools import distributed  # noqa: PLC0415
        distributed.cleanup()
    torch.save(result, results / f"rank{rank}.pt")


def run_in_processes(function, world_size: int, tmp_path: Path, *args) -> list:
    """`function(*args)` in `world_size` fresh processes with torchrun's environment (RANK, WORLD_SIZE, ...), so
    that tools.distributed.setup joins them in a gloo group, under tests.collective_guard; the return values
    (tensors, lists, dicts, numbers) in rank order. `function` must be a module-level function."""
    import torch.multiprocessing as mp  # noqa: PLC0415
    results = Path(tmp_path) / f"results-{function.__name__}"
    results.mkdir(parents=True, exist_ok=True)
    mp.spawn(_gloo_process, args=(world_size, _free_port(), function, args, results), nprocs=world_size)
    return [torch.load(results / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


def signal_when_ready(code: str, ready: Path, args: list[str], signum: int) -> subprocess.CompletedProcess:
    """Run `python -c code READY ARGS...`, send it `signum` once it has made the file READY (half-way through its
    work), and wait for it to end; its exit code and text output."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    process = subprocess.Popen([sys.executable, "-c", code, str(ready), *args], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ready.exists(), process.communicate(timeout=10)
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def load_script(path: Path):
    """A Python file outside the package (docs/make_cli.py, .ci/check_floor.py) as a module, registered in
    sys.modules under its stem while it is used (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module
