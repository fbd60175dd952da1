"""What a model is made of: `ModelRecord`, filled by the loader with every input that reached it (settings, files by
content, libraries and code, what loading computed); its digest is the model's identity. Settings are JSON values, never
paths; a record is closed once its model is built (a later write is a bug). See docs/how-it-works.md, "What a model is:
its identity".
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import importlib.metadata
import inspect
import json
import logging
import sys
import sysconfig
import types
from pathlib import Path, PurePath

import numpy as np
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


def _is_standard_library(path: Path) -> bool:
    folders = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
    return not any(part in LIBRARY_FOLDERS for part in path.parts) and any(
        path.is_relative_to(folder) for folder in folders)


def _version(module) -> str | None:
    version = getattr(module, "__version__", None)
    if version is not None:
        return str(version)
    top = module.__name__.split(".")[0]
    for distribution in importlib.metadata.packages_distributions().get(top, []):
        return importlib.metadata.version(distribution)
    return None


def _functions(cls: type) -> list[tuple[str, types.FunctionType]]:
    """The functions a class defines itself, by name (methods, static and class methods, properties' accessors)."""
    found = []
    for name, value in sorted(vars(cls).items()):
        if isinstance(value, property):
            found += [(f"{name}.{part}", f) for part, f in (("get", value.fget), ("set", value.fset),
                                                           ("del", value.fdel)) if f is not None]
            continue
        value = getattr(value, "__func__", value)
        if isinstance(value, types.FunctionType):
            found.append((name, value))
    return found


def _code_text(code: types.CodeType) -> str:
    """Compiled code as text (bytecode, constants, names), where its source is not kept."""
    constants = [_code_text(c) if isinstance(c, types.CodeType) else  # a frozenset's order varies by process
                 repr(sorted(map(repr, c))) if isinstance(c, frozenset) else repr(c) for c in code.co_consts]
    return f"{code.co_code.hex()} {constants} {code.co_names} {code.co_varnames}"


def _source_text(thing) -> str:
    """The source of a class or function, else (defined in no file) its functions' sources or compiled code."""
    try:
        return inspect.getsource(thing)
    except (OSError, TypeError):
        if isinstance(thing, types.FunctionType):
            return _code_text(thing.__code__)
        return "\n".join(f"{name}: {_source_text(function)}" for name, function in _functions(thing))


def _referenced(function: types.FunctionType) -> tuple[list, dict]:
    """What a function's code names from its globals and closure, and its defaults: (code; the other values by name)."""
    names, stack = set(), [function.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    found = {name: function.__globals__[name] for name in sorted(names) if name in function.__globals__}
    for name, cell in zip(function.__code__.co_freevars, function.__closure__ or ()):
        try:
            found[name] = cell.cell_contents
        except ValueError:  # a cell not yet filled
            continue
    # its default arguments' values, bound when it was made (`lambda x, scale=scale: x * scale`)
    found.update({f"(default {index})": value for index, value in enumerate(function.__defaults__ or ())})
    found.update({f"(default {name})": value for name, value in sorted((function.__kwdefaults__ or {}).items())})
    code = (type, types.FunctionType, types.ModuleType)
    values = {name: _configuration_value(v) for name, v in found.items() if not isinstance(v, code)}
    return [v for v in found.values() if isinstance(v, code)], {k: v for k, v in values.items() if v is not _SKIPPED}


def _kept_code(value, depth: int = 0) -> list:
    """The code a module may call through what it keeps (functions, partials, methods, classes), in containers too."""
    if depth > OBJECT_DEPTH:
        return []
    if isinstance(value, functools.partial):
        return _kept_code(value.func, depth) + _kept_code([value.args, value.keywords], depth + 1)
    if isinstance(value, types.MethodType):
        owner = value.__self__
        return [value.__func__] + ([] if isinstance(owner, nn.Module) else _kept_code(owner, depth + 1))
    if isinstance(value, (types.FunctionType, type)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [code for item in value for code in _kept_code(item, depth + 1)]
    if isinstance(value, dict):
        return [code for item in value.values() for code in _kept_code(item, depth + 1)]
    if _settings_object(value):
        return [type(value)] + [code for key, item in _attributes(value).items() if not key.startswith("_")
                                for code in _kept_code(item, depth + 1)]
    return []


def _hook_values(module: nn.Module) -> dict:
    """The hooks a module runs, in order, and whether each gets keyword arguments."""
    described = {}
    for kind, hooks, with_kwargs in (("forward pre-hooks", module._forward_pre_hooks,
                                      module._forward_pre_hooks_with_kwargs),
                                     ("forward hooks", module._forward_hooks, module._forward_hooks_with_kwargs)):
        if hooks:
            described[kind] = [[described_value(hook), key in with_kwargs] for key, hook in hooks.items()]
    return described


def described_value(value):
    """`_configuration_value(value)`, or for an object that holds no setting of its own, its class."""
    described = _configuration_value(value)
    return f"object {type(value).__module__}.{type(value).__qualname__}" if described is _SKIPPED else described


_SKIPPED = object()  # a value that holds no setting of its own (a module, a function: recorded as code; any object)


def _tensor_digest(tensor: torch.Tensor) -> str:
    """A tensor's dtype, shape and SHA-256 of its bytes (quantised, sparse, nested and meta ones too)."""
    tensor = tensor.detach()
    if tensor.is_nested:
        return f"nested {[_tensor_digest(part) for part in tensor.unbind()]}"
    described = f"{tensor.dtype} {tuple(tensor.shape)}"
    if tensor.is_meta:
        return f"{described} meta"
    if tensor.layout != torch.strided:
        return f"{described} {tensor.layout} {_tensor_digest(tensor.to_dense())}"
    if tensor.is_quantized:
        scheme = tensor.qscheme()
        if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            scales = [repr(tensor.q_scale()), tensor.q_zero_point()]
        else:
            scales = [_tensor_digest(tensor.q_per_channel_scales()),
                      _tensor_digest(tensor.q_per_channel_zero_points()), tensor.q_per_channel_axis()]
        return f"{described} {scheme} {scales} {_tensor_digest(tensor.int_repr())}"
    data = tensor.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{described} {hashlib.sha256(data).hexdigest()}"


OBJECT_DEPTH = 4  # objects inside objects a configuration follows (a config's sub-config), against cycles


def _attributes(value) -> dict:
    """An object's attributes by name, `__dict__`'s and `__slots__`', sorted."""
    found = dict(getattr(value, "__dict__", {}))
    for cls in type(value).__mro__:
        slots = vars(cls).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                found.setdefault(name, getattr(value, name))
    return dict(sorted(found.items()))


def _settings_object(value) -> bool:
    """Whether `value`'s attributes are settings: a dataclass, a namespace, or an object of a class from outside the
    standard library and torch."""
    if isinstance(value, (type, types.FunctionType, types.MethodType, types.ModuleType, nn.Module)) or \
            not (hasattr(value, "__dict__") or hasattr(type(value), "__slots__")):
        return False
    if dataclasses.is_dataclass(value) or isinstance(value, types.SimpleNamespace):
        return True
    module = sys.modules.get(type(value).__module__)
    if module is None:
        return False
    file = getattr(module, "__file__", None)
    if file is None:  # a notebook's (IPython's __main__ has no file), unless built into the interpreter
        return module.__name__ not in sys.builtin_module_names and \
            getattr(getattr(module, "__spec__", None), "origin", None) not in ("built-in", "frozen")
    return not _is_standard_library(Path(file)) and not type(value).__module__.split(".")[0] == "torch"


CYCLE = "(cycle)"  # a list, mapping or object met again within itself


def _all_or_skipped(items):
    """`items` (a list or a mapping of `_configuration_value`s), or `_SKIPPED` where one of them is."""
    values = items.values() if isinstance(items, dict) else items
    return _SKIPPED if any(v is _SKIPPED for v in values) else items


def _configuration_value(value, depth: int = 0, within: frozenset = frozenset()):
    """A value a module was built with as JSON (tensors by digest, code by name, a settings object as its class and
    attributes), or `_SKIPPED`. `within`: ids being walked; one met again is recorded as `CYCLE`."""
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        if id(value) in within:
            return CYCLE
        within = within | {id(value)}
    if isinstance(value, enum.Enum):
        return _configuration_value(value.value, depth, within)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (float, complex)):
        return repr(value)  # nan and infinities too
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format)):
        return str(value)
    if isinstance(value, np.generic) and value.dtype != object:  # a numpy scalar (np.float32(0.5)): its type and bytes
        return f"{value.dtype} {value.tobytes().hex()}"
    if isinstance(value, (bytes, bytearray)):
        return f"bytes {hashlib.sha256(value).hexdigest()}"
    if isinstance(value, (slice, range)):
        return _all_or_skipped({type(value).__name__: _configuration_value([value.start, value.stop, value.step],
                                                                           depth, within)})
    if isinstance(value, (set, frozenset)):  # in an order of their own: a set's varies by process
        items = _all_or_skipped([_configuration_value(v, depth, within) for v in value])
        return items if items is _SKIPPED else {"set": sorted(items, key=lambda v: json.dumps(v, sort_keys=True))}
    if isinstance(value, functools.partial):  # a function (or a class: partial(nn.LayerNorm, eps=1e-6)), some
        return _all_or_skipped({"partial": _configuration_value(value.func, depth, within),  # arguments given
                                "args": _configuration_value(value.args, depth, within),
                                "keywords": _configuration_value(value.keywords, depth, within)})
    if isinstance(value, types.MethodType) and not isinstance(value.__self__, (nn.Module, type)):
        owner = _configuration_value(value.__self__, depth + 1, within)  # a method of an object: its settings too
        return {"method": _configuration_value(value.__func__, depth, within),
                "of": owner if owner is not _SKIPPED else f"object {type(value.__self__).__qualname__}"}
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):  # which function: its
        return f"function {getattr(value, '__module__', None)}.{getattr(value, '__qualname__', None)}"  # code apart
    if isinstance(value, type):  # which class: its code apart
        return f"class {value.__module__}.{value.__qualname__}"
    if isinstance(value, torch.Tensor):
        return _tensor_digest(value)
    if isinstance(value, np.ndarray) and value.dtype != object:
        return f"{value.dtype} {value.shape} {hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()}"
    if isinstance(value, (list, tuple)):
        return _all_or_skipped([_configuration_value(v, depth, within) for v in value])
    if isinstance(value, dict):  # keys that are not strings as values too (a function's: by name, not its address)
        keys = [k if isinstance(k, str) else _configuration_value(k, depth, within) for k in value]
        if any(k is _SKIPPED for k in keys):
            return _SKIPPED
        return _all_or_skipped({k if isinstance(k, str) else json.dumps(k, sort_keys=True):
                                _configuration_value(v, depth, within) for k, v in zip(keys, value.values())})
    if depth < OBJECT_DEPTH and _settings_object(value):  # its public attributes, those that hold settings, and its
        if id(value) in within:  # private plain values (a transformers config's attention implementation)
            return CYCLE
        items = {key: _configuration_value(v, depth + 1, within | {id(value)}) for key, v in _attributes(value).items()
                 if _kept_setting(key, v)}
        return {"class": f"{type(value).__module__}.{type(value).__qualname__}",
                **{key: v for key, v in items.items() if v is not _SKIPPED}}
    return _SKIPPED


MODULE_INTERNALS = frozenset(vars(nn.Module()))  # torch's own attributes of every module (its mode, hooks, ...)


WHERE_READ = frozenset({"name_or_path", "_name_or_path"})  # where transformers read a model from: not what it is


def _kept_setting(name: str, value) -> bool:
    """Whether an attribute is a setting to record: a public one, or a private plain value (timm's `_fast_norm`; not a
    torch module's, such as torch.compile's `_torchdynamo_wrapper_id`, an address); never `WHERE_READ`."""
    plain = value is None or isinstance(value, (bool, int, float, str))
    return name not in WHERE_READ and (not name.startswith("_") or plain)


def _configuration_digest(model: nn.Module) -> str:
    """How each module was built beyond its state dict and code: attributes, extra tensors, hooks."""
    configuration = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            continue  # a program: its code holds its constants
        torchs = type(module).__module__.split(".")[0] == "torch"  # its private values: torch's bookkeeping
        attributes = {key: _configuration_value(value) for key, value in sorted(vars(module).items())
                      if key not in MODULE_INTERNALS and (_kept_setting(key, value) and not (torchs and key[0] == "_")
                                                          or type(value) is torch.Tensor)}
        attributes.update({f"buffer {key}": _tensor_digest(module._buffers[key]) for key in
                           sorted(module._non_persistent_buffers_set) if module._buffers.get(key) is not None})
        attributes.update(_hook_values(module))
        configuration[name] = {key: value for key, value in attributes.items() if value is not _SKIPPED}
    return hashlib.sha256(json.dumps(configuration, sort_keys=True).encode()).hexdigest()


def _script_code(module: torch.jit.ScriptModule) -> str:
    """The digest of a TorchScript module's code: every method's, with its constants."""
    parts = []
    for name in sorted(module._c._method_names()):
        code, constants = module._c._get_method(name).code_with_constants  # a dict (torch's ConstMap wraps it)
        constants = getattr(constants, "const_mapping", constants)
        parts.append(f"{name}\n{code}\n" + "\n".join(f"{key} {_configuration_value(value)}"
                                                      for key, value in sorted(constants.items())))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


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
    """Everything that reached a model's loader; `digest` is the model's identity."""

    def __init__(self):
        self.settings: dict[str, object] = {}
        self.files: dict[str, dict] = {}  # role -> {"path" or "paths", "sha256"}
        self.libraries: dict[str, str | None] = {TOOLKIT: __version__}
        self.computed: dict[str, object] = {}
        self._hashes: dict[Path, str] = {}  # each file hashed once per record
        self._closed = False

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} recorded after the model was built: it would not be in its identity")

    def setting(self, name: str, value):
        """Record a setting given or resolved (JSON-like; returned). The same name twice must agree."""
        self._check_open(f"setting {name!r}")
        plain = _plain(value, name)
        if name in self.settings and self.settings[name] != plain:
            raise RuntimeError(f"setting {name!r} recorded twice, as {self.settings[name]!r} and {plain!r}")
        self.settings[name] = plain
        return value

    def compute(self, name: str, value):
        """Record what loading computed that the inputs do not fix alone (a digest, usually); `value` is returned."""
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
        """Record several files under one role by their names relative to `base` and contents; the SHA-256 of those."""
        self._check_open(f"files {role!r}")
        paths = sorted(Path(p) for p in paths)
        lines = "".join(f"{p.relative_to(base).as_posix()} {self._hash(p)}\n" for p in paths)
        entry = {"paths": [str(p) for p in paths], "sha256": hashlib.sha256(lines.encode()).hexdigest()}
        if self.files.get(role, entry) != entry:
            raise RuntimeError(f"two sets of files recorded as {role!r}")
        self.files[role] = entry
        return entry["sha256"]

    def library(self, module, name: str | None = None) -> None:
        """Record a library's version (its __version__, so a monkeypatched one counts; else its distribution's)."""
        self._check_open("a library")
        self.libraries[name or module.__name__.split(".")[0]] = _version(module)

    def libraries_of(self, module: types.ModuleType) -> None:
        """Record the installed libraries whose modules `module` holds (the code its functions call)."""
        for value in vars(module).values():
            file = getattr(value, "__file__", None) if isinstance(value, types.ModuleType) else None
            if file is not None and _is_library_file(Path(file)) and not _is_standard_library(Path(file)):
                self.library(value)

    def code(self, model: nn.Module) -> None:
        """Record what a module runs besides its state dict: its classes' libraries or source files (or source, where no
        file holds it), what their code calls, TorchScript code, and each module's configuration (attributes, extra
        tensors, hooks, kept functions)."""
        self.setting("module classes",
                     sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in model.modules()}))
        seen: set[int] = set()
        for name, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                self.setting(f"TorchScript code {name or '(top)'}", _script_code(module))
                continue
            if isinstance(module, torch.fx.GraphModule):  # an exported program's module: its graph is its code
                self.setting(f"graph code {name or '(top)'}", hashlib.sha256(module.code.encode()).hexdigest())
                continue
            self._code_of(type(module), seen)
            kept = [value for key, value in sorted(vars(module).items()) if not key.startswith("_")]
            hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
            for code in _kept_code(hooks + kept):
                self._code_of(code, seen)
        self.setting("module configuration", _configuration_digest(model))

    def _code_of(self, thing, seen: set[int]) -> None:
        """Record the code of a class, function or module (`code`), and what its code calls, once each."""
        thing = getattr(thing, "__func__", thing)  # a bound method, as a hook may be
        if id(thing) in seen or thing is object or not isinstance(thing, (type, types.FunctionType, types.ModuleType)):
            return
        seen.add(id(thing))
        module_name = thing.__name__ if isinstance(thing, types.ModuleType) else getattr(thing, "__module__", None)
        module = sys.modules.get(module_name or "")
        file = getattr(module, "__file__", None)
        if file is not None and _is_library_file(Path(file)):
            if not _is_standard_library(Path(file)):  # which goes with Python
                self.library(sys.modules[module_name.split(".")[0]])
            return
        if file is not None:
            self.read_file(file, f"code {module_name}")
        elif isinstance(thing, types.ModuleType):  # built into the interpreter
            return
        else:  # defined where no file holds it (an interactive session, a notebook): its own source
            self._numbered_setting(f"code {module_name}.{thing.__qualname__}",
                                   hashlib.sha256(_source_text(thing).encode()).hexdigest())
        if isinstance(thing, types.ModuleType):  # its file holds its code; what it imports is not followed
            return
        for base in thing.__mro__[1:] if isinstance(thing, type) else ():
            self._code_of(base, seen)
        functions = [thing] if isinstance(thing, types.FunctionType) else [f for _, f in _functions(thing)]
        for function in functions:
            called, values = _referenced(function)
            for other in called:
                self._code_of(other, seen)
            if values:
                self._numbered_setting(f"globals read by {function.__module__}.{function.__qualname__}",
                                       hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest())

    def _numbered_setting(self, name: str, value: str) -> None:
        """Record `value` under `name`, numbered in walk order where another value holds it."""
        numbered, count = name, 1
        while self.settings.get(numbered, value) != value:
            count += 1
            numbered = f"{name} #{count}"
        self.setting(numbered, value)

    def close(self) -> None:  # the model is built: nothing more may be recorded
        self._closed = True

    @property
    def digest(self) -> str:
        """The model's identity: the SHA-256 of settings, files by role and content, libraries and computed."""
        return self.digest_of(self.describe())

    @staticmethod
    def digest_of(described: dict) -> str:
        """The identity of a record as `describe` gives it (a results file's provenance)."""
        content = _content(described.get("settings", {}), described.get("libraries", {}),
                           described.get("files", {}), described.get("computed", {}))
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def describe(self) -> dict:
        """The record as the provenance shows it: settings, files (with their paths), libraries and computed."""
        return {"settings": dict(self.settings), "files": {role: dict(entry) for role, entry in self.files.items()},
                "libraries": dict(self.libraries), "computed": dict(self.computed)}
