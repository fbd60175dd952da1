"""What several test modules share besides fixtures (those are in conftest.py): running a command in this process
or in torchrun-like processes, saving hand-built models, checking an error line, the tiny CLIP architecture."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from html.parser import HTMLParser
from pathlib import Path

import torch

import tools
from tools.models.architectures import SMALL_CNN

# train.py's flags for a small CNN trained on the CPU, quietly
TINY = ["--arch", SMALL_CNN, "--device", "cpu", "--no-progress", "--log-level", "WARNING", "--workers", "0"]


def save_torchscript(model: torch.nn.Module, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.trace(model.eval(), torch.zeros(2, 3, 224, 224)), str(path))


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


def run_train(argv, capsys):
    """train.py's main in this process, every argument as a string; (exit code, stdout, stderr)."""
    import train  # noqa: PLC0415 (the root script, loaded by the tests that train)
    return run_in_process(train.main, [str(a) for a in argv], capsys)


def weights(path: Path) -> dict:
    """The model's state dict in a checkpoint train.py saved."""
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


def check_error(code: int, out: str, err: str, lines: int | None = 1) -> str:
    """Exit code 2, no traceback, nothing on stdout, and the error as the one (last) line of stderr
    (the only line, unless `lines` says otherwise)."""
    assert code == 2, err
    assert "Traceback" not in err, err
    assert out == ""
    err_lines = err.splitlines()
    errors = [line for line in err_lines if line.startswith("error: ")]
    assert len(errors) == 1, err
    assert err_lines[-1] == errors[0]
    if lines is not None:
        assert len(err_lines) == lines, err
    return errors[0]


class TinyCNN(torch.nn.Module):
    """A random convolutional classifier whose predictions vary from image to image."""

    def __init__(self, num_classes: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.conv = torch.nn.Conv2d(3, 8, 5, stride=4)
        self.fc = torch.nn.Linear(8, num_classes)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean(dim=(2, 3)))


# Files a loader reads: an audit hook (Python's `open` event, raised for every file opened from Python: builtins,
# io, os, imports) records those opened for reading in the thread of an open `files_read` block. Files opened by
# native code (safetensors' Rust, TorchScript's C++) raise no event: a source records those where it names them.
_READS: list[tuple[int, list[Path]]] = []
TOOLKIT = Path(tools.__file__).resolve().parent
_AUDITING: list[bool] = []


def _audit(event: str, args) -> None:
    if event != "open" or not _READS or _READS[-1][0] != threading.get_ident():
        return
    path, mode, flags = args
    if isinstance(path, (str, bytes, os.PathLike)):
        writes = any(c in str(mode) for c in "wax+") if mode else bool(flags & (os.O_WRONLY | os.O_RDWR))
        if not writes:
            _READS[-1][1].append(Path(os.fsdecode(path)))


@contextlib.contextmanager
def files_read():
    """The files opened for reading in this thread inside the block (a list, filled as they are opened)."""
    if not _AUDITING:  # an audit hook cannot be removed: one for the session, idle outside the blocks
        sys.addaudithook(_audit)
        _AUDITING.append(True)
    read: list[Path] = []
    _READS.append((threading.get_ident(), read))
    try:
        yield read
    finally:
        _READS.pop()


def unrecorded_reads(read: list[Path], record) -> list[str]:
    """The files read that hold content the model's record does not: each file read must be a recorded file (or a
    copy of one: transformers imports a model's code from its own copy), library code or data (site-packages, the
    standard library, compiled caches, the toolkit's own code, installed packages' metadata wherever it is, as the
    toolkit's editable egg-info that looking up a library's version reads: the record holds their versions), the
    toolkit's cache (a CLIP text head computed before: the record holds its digest), a hub cache's `refs/` pointer
    to the snapshot whose files are recorded, or an empty package marker."""
    from tools.data.store import default_cache_dir  # noqa: PLC0415 (where the session's fixture points it)
    described = record.describe()
    recorded = {entry["sha256"] for entry in described["files"].values() if "path" in entry}
    recorded |= {hashlib.sha256(Path(path).read_bytes()).hexdigest() for entry in described["files"].values()
                 for path in entry.get("paths", [])}
    missing = []
    for path in dict.fromkeys(p.resolve() for p in read):
        parts = path.parts
        if (not path.is_file() or "site-packages" in parts or "__pycache__" in parts or path.is_relative_to(TOOLKIT)
                or path.parent.suffix in (".egg-info", ".dist-info")
                or path.is_relative_to(default_cache_dir().resolve())
                or str(path).startswith((sys.base_prefix, "/proc", "/sys", "/dev"))
                or (len(parts) > 2 and parts[-2] == "refs" and parts[-3].startswith("models--"))):
            continue
        content = path.read_bytes()
        if hashlib.sha256(content).hexdigest() not in recorded and (content or path.name != "__init__.py"):
            missing.append(str(path))
    return missing


TINY_CLIP = "bgc-tiny-clip"
TINY_CLIP_OPTIONS = "+templates=simple"  # 7 templates: the 1000-class head is 7000 prompts, not 80000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gloo_process(rank: int, world_size: int, port: int, function, args, results: Path, environ: dict) -> None:
    os.environ.clear()  # the caller's environment, as a spawned process has it (the fork server's is older)
    os.environ.update(environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from tests import collective_guard  # noqa: PLC0415
    collective_guard.install()
    try:
        result = function(*args)
    finally:
        from tools import distributed  # noqa: PLC0415
        distributed.cleanup()
    torch.save(result, results / f"rank{rank}.pt")


# What every process of run_in_processes imports, imported once by the fork server that starts them: each process
# is a fork of a fresh interpreter that has imported these (and run nothing), not a new interpreter that pays
# torch's import again (seconds each on a 2-core machine).
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "tools.distributed", "tools.challenge", "tools.training.loop",
                       "tests.collective_guard"]


def run_in_processes(function, world_size: int, tmp_path: Path, *args) -> list:
    """`function(*args)` in `world_size` new processes (forks of the fork server: FORK_SERVER_PRELOAD) with the
    caller's environment and torchrun's (RANK, WORLD_SIZE, ...), so that tools.distributed.setup joins them in a
    gloo group, under tests.collective_guard; the return values (tensors, lists, dicts, numbers) in rank order.
    `function` must be a module-level function. Forks of one server share its str hash seed (torchrun's processes
    each draw their own): an order that depends on hashing differs between ranks only under real torchrun (the
    torchrun tests of tests/test_distributed.py and tests/test_train.py)."""
    import multiprocessing  # noqa: PLC0415

    import torch.multiprocessing as mp  # noqa: PLC0415
    results = Path(tmp_path) / f"results-{function.__name__}"
    results.mkdir(parents=True, exist_ok=True)
    multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)  # used when the server starts: the first call
    mp.start_processes(_gloo_process, args=(world_size, _free_port(), function, args, results, dict(os.environ)),
                       nprocs=world_size, start_method="forkserver")
    return [torch.load(results / f"rank{rank}.pt", weights_only=True) for rank in range(world_size)]


# Runs each command in a fork of an interpreter that has imported torch and nothing else of note (no toolkit
# module): what `python ARGS...` would do after its own `import torch`, less that import.
_FORKED = r"""
import atexit, json, os, runpy, sys, tempfile, traceback

def captured(fd, file):
    os.dup2(file.fileno(), fd)

kept = os.dup(1), os.dup(2)
with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:  # what the import prints, each command too
    captured(1, out)
    captured(2, err)
    import torch  # noqa: F401
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(kept[0], 1)
    os.dup2(kept[1], 2)
    out.seek(0)
    err.seek(0)
    start = out.read().decode(), err.read().decode()

def run(argv):
    if argv[0] == "-m":  # as `python -m NAME`: the current folder first on the path, NAME's file as argv[0]
        sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *argv[2:]], ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:  # a script by path: its folder first on the path (links resolved), its __file__ absolute
        sys.argv, sys.path[0] = list(argv), os.path.dirname(os.path.realpath(argv[0]))
        runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")

results = []
for argv in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            captured(1, out)
            captured(2, err)
            code = 0
            try:
                run(argv)
            except SystemExit as stop:  # as the interpreter ends on it
                code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            atexit._run_exitfuncs()  # as the interpreter does at its end
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        results.append([code, start[0] + out.read().decode(), start[1] + err.read().decode()])
print(json.dumps(results))
"""


def run_forked(commands: list[list[str]], cwd: Path, env: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Each command (the arguments of `python ...`: a script by path, `-m MODULE` or `-c CODE`, then its own) as
    that command would run, with its exit code and output, but in a fork of one interpreter that imported torch
    first: one start-up for all instead of seconds each. Each fork starts with no toolkit module loaded, so what
    a command imports, in which order, is what a fresh interpreter would; torch (which loads none of the toolkit)
    is already there, so no check through it can say a command does not load torch. Unlike a process of its own:
    non-daemon threads are not waited for at the end, an uncaught KeyboardInterrupt exits 1, and a `-c` command's
    `import __main__` is the harness's."""
    import json  # noqa: PLC0415
    proc = subprocess.run([sys.executable, "-c", _FORKED, json.dumps(commands)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [subprocess.CompletedProcess([sys.executable, *command], code, out, err)
            for command, (code, out, err) in zip(commands, json.loads(proc.stdout.splitlines()[-1]))]


def signal_when_ready(code: str, ready: Path, args: list[str], signum: int) -> subprocess.CompletedProcess:
    """Run `python -c code READY ARGS...`, send it `signum` once it has made the file READY (half-way through its
    work), and wait for it to end; its exit code and text output.

    The process starts as one started from a terminal, where Ctrl-C raises KeyboardInterrupt: a test run
    started with SIGINT ignored (seen: the floor check run as a background job of a script) passes that
    to its children, and Python then installs no handler, so SIGINT would do nothing."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = f"import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n{code}"
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


class Page(HTMLParser):
    """What a test reads back from the page: tables (cells as (text, data-value)), images, and ids' data-values."""

    def __init__(self, text: str):
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, str | None]]]] = {}
        self.images: list[dict] = []
        self.values: dict[str, str] = {}
        self.body: dict = {}
        self._table = self._cell = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body = attrs
        if "id" in attrs and "data-value" in attrs:
            self.values[attrs["id"]] = attrs["data-value"]
        if tag == "table":
            self._table = self.tables.setdefault(attrs["data-table"], [])
        elif tag == "tr" and self._table is not None:
            self._table.append([])
        elif tag in ("td", "th") and self._table is not None:
            self._cell = ["", attrs.get("data-value")]
        elif tag == "img":
            self.images.append(attrs)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._table[-1].append((self._cell[0].strip(), self._cell[1]))
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[0] += data

    def rows(self, name: str) -> dict[str, list[tuple[str, str | None]]]:
        """A table's body rows by their first cell's text."""
        return {row[0][0]: row[1:] for row in self.tables[name][1:]}


def run_command(main, argv: list[str]) -> None:
    """A command's main run in this process, which must succeed; the logging set-up it makes is undone."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        assert main(argv) == 0
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def html_runs(dataset, color_ts, out: Path) -> tuple[Path, dict]:
    """in9_eval (all variations, categories) and challenge_eval --full --analysis on the generated data, each
    writing its results JSON and its HTML report; then the report command's page of all of them."""
    from tools.challenge import cli as challenge_cli  # noqa: PLC0415
    from tools.in9 import cli as in9_eval  # noqa: PLC0415 (the commands load only for the tests that run them)
    from tools.results.html import write_html  # noqa: PLC0415
    from tools.results.reading import load_inputs  # noqa: PLC0415

    common = ["--data-path", str(dataset.root), "--checkpoint", str(color_ts[9]), "--trust-checkpoint", "--in9",
              "--device", "cpu",
              "--log-level", "WARNING", "--workers", "1"]
    run_command(in9_eval.main, ["--eval-dataset", "all", "--categories", "--results-file", str(out / "in9.json"),
                                "--html", str(out / "in9.html"), "--output-dir", str(out / "in9_state"), *common])
    run_command(challenge_cli.main, ["--full", "--analysis", "--no-cache", "--results-file",
                                     str(out / "challenge.json"), "--html", str(out / "challenge.html"),
                                     "--output-dir", str(out / "matrix"), *common])
    inputs = load_inputs(out / "in9.json", out / "challenge.json", out / "matrix")
    write_html(out / "report.html", **inputs, data_path=dataset.root)
    return out, inputs


# A file outside every data folder that a report or figure must not show, whatever a results file names: an image of
# one colour far from every generated image's (tools.data.synthetic's palette), found again in any picture.
SECRET_COLOUR = (100, 255, 160)


def secret_image(folder: Path, name: str = "secret.png") -> Path:
    from PIL import Image  # noqa: PLC0415
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 64), SECRET_COLOUR).save(folder / name)
    return folder / name


def shows_secret(image) -> bool:
    """Whether a fifth or more of a picture (a PIL image) is SECRET_COLOUR, give or take JPEG's blur."""
    import numpy as np  # noqa: PLC0415
    pixels = np.asarray(image.convert("RGB")).astype(int)
    return bool((np.abs(pixels - np.array(SECRET_COLOUR)).sum(axis=2) < 60).mean() >= 0.2)


def page_shows_secret(text: str) -> bool:
    """Whether any picture of an HTML page (its data URIs) shows SECRET_COLOUR."""
    import base64  # noqa: PLC0415
    import io  # noqa: PLC0415

    from PIL import Image  # noqa: PLC0415
    for img in Page(text).images:
        if img["src"].startswith("data:"):
            with Image.open(io.BytesIO(base64.b64decode(img["src"].split(",", 1)[1]))) as shown:
                if shows_secret(shown):
                    return True
    return False
