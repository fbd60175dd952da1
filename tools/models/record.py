"""What a model is made of: `ModelRecord`, which the loader fills with every input that reached it, and whose digest
is the model's identity.

A record holds four things, each put there by the code that gives or reads it:
- settings (`setting`): what the loader was given (the model's name less its files, `--checkpoint-key`,
  `--lora-alpha`, ...) and what it resolved from them (the state dict's place in the file, a tag's data config,
  an image processor's pixel map, the normalisation used): JSON values, never paths;
- files (`read_file`, `read_files`): each file read, under a role ("checkpoint", "weights", "config.json", ...),
  by its SHA-256 as it is when read; its path is shown but is no part of the identity;
- libraries (`library`, `code`): the versions of the libraries that read the files and build the model, and
  the source files of code outside them that the model runs (a pickled module's classes);
- computed (`computed`): what loading computed that the inputs above do not fix alone (CLIP's text head,
  encoded on the run's device; seeded random weights, drawn by the installed torch), by digest.

The identity (`digest`) is the SHA-256 of all four (files by role and hash): the same inputs give the same
identity wherever the files lie, and another input another. The results' provenance shows
the record (`describe`), resume states and the zoo's "already done" are keyed by its digest. A record is closed
(`close`) once its model is built: what is recorded later is a bug.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib.metadata
import inspect
import json
import logging
import sys
from pathlib import Path, PurePath

import torch
from torch import nn

from tools import __version__
from tools.data.hashing import sha256_file

log = logging.getLogger(__name__)

FORMAT = 1  # of the digested text: another format is another identity
TOOLKIT = "toolkit"  # the libraries' name of this toolkit, the loader itself
LIBRARY_FOLDERS = ("site-packages", "dist-packages")  # where installed libraries' code lies (their versions cover it)


def _plain(value, name: str):
    """`value` as plain JSON (enums by value, tuples as lists); a path is refused: a file is recorded by content."""
    if isinstance(value, PurePath):
        raise TypeError(f"setting {name!r} is a path ({value}): record the file's content with read_file")
    if isinstance(value, enum.Enum):
        return _plain(value.value, name)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return float(value)
    if isinstance(value, torch.Tensor):
        return _plain(value.tolist(), name)
    if isinstance(value, (list, tuple)):
        return [_plain(v, name) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, name) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value), name)
    raise TypeError(f"setting {name!r} is a {type(value).__name__}, which a record cannot hold")


def _is_library_file(path: Path) -> bool:
    return any(part in LIBRARY_FOLDERS for part in path.parts) or str(path).startswith(sys.base_prefix + "/lib")


def _version(module) -> str | None:
    """A module's version: its __version__, else its distribution's."""
    version = getattr(module, "__version__", None)
    if version is not None:
        return str(version)
    top = module.__name__.split(".")[0]
    for distribution in importlib.metadata.packages_distributions().get(top, []):
        return importlib.metadata.version(distribution)
    return None


def installed_version(name: str) -> str | None:
    """The version a record would hold for the library `name` now (None when it cannot be imported)."""
    if name == TOOLKIT:
        return __version__
    try:
        return _version(importlib.import_module(name))
    except ImportError:
        return None


def _content(settings: dict, libraries: dict, files: dict, computed: dict) -> dict:
    return {"format": FORMAT, "settings": settings, "libraries": libraries, "computed": computed,
            "files": {role: entry["sha256"] for role, entry in files.items()}}


class ModelRecord:
    """Everything that reached a model's loader (see the module's docstring); `digest` is the model's identity."""

    def __init__(self):
        self.settings: dict[str, object] = {}
        self.files: dict[str, dict] = {}  # role -> {"path" or "paths", "sha256"}
        self.libraries: dict[str, str | None] = {TOOLKIT: __version__}  # this loader's own version
        self.computed: dict[str, object] = {}
        self._hashes: dict[Path, str] = {}  # each file hashed once per record
        self._closed = False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} recorded after the model was built: it would not be in its identity")

    def setting(self, name: str, value):
        """Record a setting given or resolved; `value` (returned) must be JSON-like. The same name twice must
        agree."""
        self._check_open(f"setting {name!r}")
        plain = _plain(value, name)
        if name in self.settings and self.settings[name] != plain:
            raise RuntimeError(f"setting {name!r} recorded twice, as {self.settings[name]!r} and {plain!r}")
        self.settings[name] = plain
        return value

    def compute(self, name: str, value):
        """Record what loading computed that the recorded inputs do not fix alone (on the run's device, with the
        installed torch): a digest, usually; `value` is returned."""
        self._check_open(f"computed {name!r}")
        plain = _plain(value, name)
        if name in self.computed and self.computed[name] != plain:
            raise RuntimeError(f"{name!r} computed twice, as {self.computed[name]!r} and {plain!r}")
        self.computed[name] = plain
        return value

    def _hash(self, path: Path) -> str:
        key = path.absolute()
        if key not in self._hashes:
            self._hashes[key] = sha256_file(path)
        return self._hashes[key]

    def read_file(self, path: Path | str, role: str) -> str:
        """Record the file `path` under `role` by its content (hashed now); its SHA-256."""
        self._check_open(f"file {role!r}")
        path = Path(path)
        entry = {"path": str(path), "sha256": self._hash(path)}
        if self.files.get(role, entry) != entry:
            raise RuntimeError(f"two files recorded as {role!r}: {self.files[role]} and {entry}")
        self.files[role] = entry
        return entry["sha256"]

    def read_files(self, paths, role: str, base: Path) -> str:
        """Record several files under one role (a sharded checkpoint, a repository's code), by their names
        relative to `base` and their contents; the SHA-256 of those names and hashes."""
        self._check_open(f"files {role!r}")
        paths = sorted(Path(p) for p in paths)
        lines = "".join(f"{p.relative_to(base).as_posix()} {self._hash(p)}\n" for p in paths)
        entry = {"paths": [str(p) for p in paths], "sha256": hashlib.sha256(lines.encode()).hexdigest()}
        if self.files.get(role, entry) != entry:
            raise RuntimeError(f"two sets of files recorded as {role!r}")
        self.files[role] = entry
        return entry["sha256"]

    def library(self, module, name: str | None = None) -> None:
        """Record the version of a library that reads the files or builds the model (its __version__, so a
        monkeypatched one counts; else its distribution's)."""
        self._check_open("a library")
        self.libraries[name or module.__name__.split(".")[0]] = _version(module)

    def code(self, model: nn.Module) -> None:
        """Record the code a module runs: for each class in it, its library's version, or the source file of a
        class from outside the installed libraries (a pickled module's own classes, a notebook's), and the code of
        each TorchScript module in it; the classes themselves by name."""
        self.setting("module classes",
                     sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}))
        for name, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                text = getattr(module, "code", "") or ""
                self.setting(f"TorchScript code {name or '(top)'}", hashlib.sha256(text.encode()).hexdigest())
                continue
            if isinstance(module, torch.fx.GraphModule):  # an exported program's module: its graph is its code
                self.setting(f"graph code {name or '(top)'}", hashlib.sha256(module.code.encode()).hexdigest())
                continue
            cls = type(module)
            source = sys.modules.get(cls.__module__)
            file = getattr(source, "__file__", None)
            if file is not None and _is_library_file(Path(file)):
                self.library(sys.modules[cls.__module__.split(".")[0]])
            elif file is not None:
                self.read_file(file, f"code {cls.__module__}")
            else:  # a class defined where no file holds it (an interactive session): its own source, if known
                try:
                    text = inspect.getsource(cls)
                except (OSError, TypeError):
                    text = None
                    log.warning("the code of %s.%s cannot be read: the model's identity cannot hold it",
                                cls.__module__, cls.__qualname__)
                self.setting(f"code {cls.__module__}.{cls.__qualname__}",
                             None if text is None else hashlib.sha256(text.encode()).hexdigest())

    def close(self) -> None:
        """The model is built: nothing more may be recorded."""
        self._closed = True

    @property
    def digest(self) -> str:
        """The model's identity: the SHA-256 of its settings, files (by role and content), libraries and what
        loading computed."""
        return self.digest_of(self.describe())

    @staticmethod
    def digest_of(described: dict) -> str:
        """The identity of a record as `describe` gives it (as a results file's provenance holds it)."""
        content = _content(described.get("settings", {}), described.get("libraries", {}),
                           described.get("files", {}), described.get("computed", {}))
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def describe(self) -> dict:
        """The record as the provenance shows it: settings, files (with their paths), libraries and computed."""
        return {"settings": dict(self.settings), "files": {role: dict(entry) for role, entry in self.files.items()},
                "libraries": dict(self.libraries), "computed": dict(self.computed)}
