"""Whether a `torch.export` archive (.pt2) is data, read from its members without loading it.

torch's loader is not a data reader: an archive can make it unpickle with any globals, load AOTInductor libraries,
`eval` shape expressions with sympy, run `guards_code`, and generate Python source from the program's names. So an
archive is data only when every member is tensors, text or JSON and every pickle loads `weights_only`; every operator is
ATen or prims (not `FILE_OPERATIONS`), control flow over subgraphs, or shape arithmetic; and every string is what its
field allows. Unknown fields are refused (an allowlist: torch's next format is refused until read here).

The archive is checked as each of torch's readers sees it (miniz, the newer format's; zipfile, the older's and the
fallback): they can find other members in one file, and names that differ only in case are refused.
"""

from __future__ import annotations

import ast
import io
import json
import re
import zipfile
from pathlib import Path

import torch

# members of the archive format of torch >= 2.7 (`<root>/...`), relative to the root folder
TEXT_MEMBERS = frozenset({"archive_format", "archive_version", "byteorder", "version", ".data/version",
                          ".data/serialization_id"})
PROGRAM = re.compile(r"models/[^/]+\.json")
PAYLOAD_CONFIG = re.compile(r"data/(weights|constants)/[^/]+_(weights|constants)_config\.json")
PICKLE = re.compile(r"data/(weights|constants|sample_inputs)/[^/]+\.pt")  # legacy weights, example inputs
RAW_PAYLOAD = re.compile(r"data/(weights|constants)/[^/]+")  # bytes a payload config points at, never unpickled
# members of the older format (torch <= 2.6, and later torch's fallback), at the top level
OLD_PROGRAM = "serialized_exported_program.json"
OLD_PICKLES = frozenset({"serialized_state_dict.pt", "serialized_state_dict.json", "serialized_constants.pt",
                         "serialized_constants.json", "serialized_example_inputs.pt"})

OPERATOR_NAMESPACES = ("aten", "prims")
FILE_OPERATIONS = frozenset({"from_file", "save", "_print", "warn"})  # ATen operations that touch files or print
CONTROL_FLOW = frozenset({"cond", "while_loop", "map_impl", "scan", "associative_scan", "invoke_subgraph",
                          "wrap_with_set_grad_enabled", "wrap_with_autocast"})
PYTHON_OPERATORS = frozenset(  # what an export records for shape arithmetic and grad modes (torch's verifier's list)
    [f"_operator.{name}" for name in ("getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg",
                                      "pos", "abs", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_",
                                      "lshift", "rshift", "invert", "xor")]
    + [f"math.{name}" for name in ("ceil", "floor", "trunc", "sqrt")]
    + [f"torch.{name}" for name in ("sym_int", "sym_float", "sym_ite", "sym_max", "sym_min", "sym_not", "sym_sqrt",
                                    "sym_sum", "_sym_sqrt")]
    + ["torch._C._set_grad_enabled", "torch.autograd.grad_mode.set_grad_enabled",
       "torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast"])

# sympy's and torch's functions that the shape expressions torch writes (sympy's srepr) are made of
SYMPY_FUNCTIONS = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Abs", "Mod", "floor", "ceiling",
    "sqrt", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "LessThan",
    "StrictGreaterThan", "GreaterThan", "And", "Or", "Not", "Xor", "ITE", "Piecewise", "ExprCondPair",
    "IntInfinity", "NegativeIntInfinity", "Tuple",
    # torch.utils._sympy.functions, as torch's deserializer names them
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift",
    "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator",
    "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "BitwiseFn_bitwise_and",
    "BitwiseFn_bitwise_or", "OpaqueUnaryFn_sqrt"})
SYMPY_CONSTANTS = frozenset({"oo", "zoo", "nan", "true", "false", "True", "False", "int_oo", "pi", "E"})
SYMPY_NODES = (ast.Expression, ast.Call, ast.Name, ast.Load, ast.Constant, ast.keyword, ast.UnaryOp, ast.USub,
               ast.UAdd, ast.Not, ast.BinOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
               ast.Compare, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.BoolOp, ast.And, ast.Or)

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SYMBOL_NAME = re.compile(r"[a-z]+[0-9]+")  # torch's shape symbols: s0, s77, u3, zuf0, ...
QUALIFIED_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")  # a weight's or submodule's name: l.0.weight
DOTTED_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
NUMBER = re.compile(r"[-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?")

# the rule for every string field of the program's schema (torch._export.serde.schema), by field name
NAME_FIELDS = frozenset({"name", "as_name"})
QUALIFIED_FIELDS = frozenset({"parameter_name", "buffer_name", "tensor_constant_name", "custom_obj_name",
                              "user_input_name"})
# tables keyed by names, and the rule for their keys (a payload config's table is keyed by weight names)
KEYED_TABLES = {**dict.fromkeys(("tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values",
                                 "custom_obj_values", "range_constraints", "opset_version", "as_string_to_argument",
                                 "treespec_namedtuple_fields"), DOTTED_IDENTIFIER), "config": QUALIFIED_NAME}
FREE_TEXT = frozenset({"as_string", "as_strings"})  # written into generated code with repr(): any text
LIST_FIELDS = frozenset({"as_strings", "forward_arg_names", "field_names", "verifiers", "guards_code"})


def untrusted_content(path: Path) -> list[str]:
    """What in the export archive at `path` is more than tensors and tensor operations ([]: data); loads nothing."""
    findings: list[str] = []
    with zipfile.ZipFile(path) as archive:  # the older format's reader (and the newer format's members, as listed)
        names = archive.namelist()
        if _same_names(names):
            return ["members of the same name twice"]
        for name in names:
            _check_member(archive.read, name, findings)
    try:  # the newer format's reader, as torch.export.load opens it: what it lists and reads is what it loads
        reader = torch._C.PyTorchFileReader(str(path))
        records = reader.get_all_records()
    except (RuntimeError, UnicodeDecodeError):  # torch's loader cannot read the newer format here either
        return list(dict.fromkeys(findings))
    if _same_names(records):
        return ["members of the same name twice"]
    for record in records:
        _check_relative(reader.get_record, record, record, findings)
    return list(dict.fromkeys(findings))


def _same_names(names: list[str]) -> bool:
    """Whether two names are one to either zip reader (miniz compares names in any ASCII case)."""
    return len({name.encode("utf-8", "surrogateescape").lower() for name in names}) != len(names)


def _check_member(read, name: str, findings: list[str]) -> None:
    """A member as zipfile lists it: the older format's at the top, the newer's under the root folder."""
    if name in (OLD_PROGRAM, "version") or name.startswith("extra_files/") and "/" not in name[12:]:
        if name == OLD_PROGRAM:
            _check_program(read(name), name, findings)
        return
    if name in OLD_PICKLES:
        _check_pickle(read(name), name, findings)
        return
    _, slash, relative = name.partition("/")
    if not slash:
        findings.append(f"member {name}, which the toolkit does not know")
    else:
        _check_relative(read, name, relative, findings)


def _check_relative(read, name: str, relative: str, findings: list[str]) -> None:
    """A newer-format member by its name under the root folder (one torch cannot read, torch cannot load)."""
    def data() -> bytes:
        try:
            return read(name)
        except RuntimeError:
            return b""
    if relative in TEXT_MEMBERS or relative.startswith("extra/") or relative.endswith("/"):
        pass
    elif PROGRAM.fullmatch(relative):
        _check_program(data(), name, findings)
    elif PAYLOAD_CONFIG.fullmatch(relative):
        _check_payload_config(data(), name, relative.startswith("data/weights/"), findings)
    elif PICKLE.fullmatch(relative):
        _check_pickle(data(), name, findings)
    elif RAW_PAYLOAD.fullmatch(relative):
        pass
    elif relative.startswith("data/aotinductor/"):
        findings.append(f"AOTInductor compiled code ({name})")
    else:
        findings.append(f"member {name}, which the toolkit does not know")


def _check_pickle(data: bytes, name: str, findings: list[str]) -> None:
    """A pickle must load weights-only: where that fails, torch unpickles fully."""
    if not data:
        return
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 (whatever stops the weights-only unpickler makes it code to torch)
        findings.append(f"a pickle that needs more than weights-only unpickling ({name})")


def _json(data: bytes, name: str, findings: list[str]):
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        findings.append(f"{name}, which is not JSON")
        return None


def _check_payload_config(data: bytes, name: str, weights: bool, findings: list[str]) -> None:
    """The weights' or constants' table: each entry raw bytes read as a tensor, never a pickle or an object."""
    config = _json(data, name, findings)
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        findings.append(f"{name}, which is not a table of tensors")
        return
    what = "weight" if weights else "constant"
    for key, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path_name"), str):
            findings.append(f"{name}, which is not a table of tensors")
            continue
        path_name = entry["path_name"]
        if not weights and path_name.startswith("custom_obj_"):
            findings.append(f"custom object constant {key!r}")
        elif not weights and path_name.startswith("opaque_obj_"):
            findings.append(f"pickled Python object constant {key!r}")
        elif entry.get("use_pickle") is not False:
            findings.append(f"pickled {what} {key!r}")
        elif not weights and not path_name.startswith("tensor_"):
            findings.append(f"constant {key!r} of unknown kind {path_name!r}")
        if not QUALIFIED_NAME.fullmatch(key) or not QUALIFIED_NAME.fullmatch(path_name):
            findings.append(f"{what} name {key!r} -> {path_name!r}, which is not a plain name")
        _check_strings(entry.get("tensor_meta"), findings)


def _check_program(data: bytes, name: str, findings: list[str]) -> None:
    program = _json(data, name, findings)
    if program is None:
        return
    if not isinstance(program, dict):
        findings.append(f"{name}, which is not an exported program")
        return
    if program.get("guards_code"):
        findings.append("Python guard code (guards_code)")
    _check_strings(program, findings)


def _check_strings(obj, findings: list[str]) -> None:
    """Every string of a program (or of a tensor's description) against the rule for its field."""
    if isinstance(obj, list):
        for item in obj:
            _check_strings(item, findings)
        return
    if not isinstance(obj, dict):
        if isinstance(obj, str):
            findings.append(f"text {_short(obj)} where the program's format has none")
        return
    if "nodes" in obj and isinstance(obj.get("inputs"), list):  # a graph: its inputs become Python parameters
        for argument in obj["inputs"]:
            if isinstance(argument, dict) and FREE_TEXT & argument.keys():
                findings.append("a string input to a graph")
    for key, value in obj.items():
        if key == "metadata":  # stack traces and provenance, kept as text (never code) when on one line
            for text in (value.values() if isinstance(value, dict) else [value]):
                if not isinstance(text, str) or "\r" in text:
                    findings.append(f"metadata {_short(text)}")
        elif key in KEYED_TABLES and isinstance(value, dict):
            findings += [f"name {_short(name)}" for name in value if not KEYED_TABLES[key].fullmatch(name)]
            _check_strings(list(value.values()), findings)
        elif isinstance(value, (dict, list)) and key not in LIST_FIELDS:
            _check_strings(value, findings)
        elif value is not None and not isinstance(value, (bool, int, float)):
            _check_field(key, value, findings)


def _check_field(key: str, value, findings: list[str]) -> None:
    texts = value if key in LIST_FIELDS and isinstance(value, list) else [value]
    if not all(isinstance(text, str) for text in texts) or (key not in LIST_FIELDS) != isinstance(value, str):
        findings.append(f"field {key!r} of unexpected content")
    elif key in FREE_TEXT or key in ("guards_code", "torch_version"):
        if any("\r" in text for text in texts):
            findings.append(f"text {_short(value)}")
    elif key in ("target", "as_operator"):
        if not _allowed_operator(value):
            findings.append(f"operator {_short(value)}")
    elif key == "expr_str":
        if not _plain_expression(value):
            findings.append(f"shape expression {_short(value)}")
    elif key in NAME_FIELDS or key in ("forward_arg_names", "field_names"):
        findings += [f"name {_short(text)}" for text in texts if text and not IDENTIFIER.fullmatch(text)]
    elif key in QUALIFIED_FIELDS or key in ("fqn", "path_name"):
        findings += [f"name {_short(text)}" for text in texts if text and not QUALIFIED_NAME.fullmatch(text)]
    elif key in ("in_spec", "out_spec"):
        if not _plain_tree_spec(value):
            findings.append(f"input or output structure {_short(value)}")
    elif key in ("type", "verifiers", "dialect"):  # a device's type, the verifiers' dialects
        findings += [f"name {_short(text)}" for text in texts if text and not IDENTIFIER.fullmatch(text)]
    elif key == "class_fqn":
        findings.append(f"custom object of class {_short(value)}")
    else:
        findings.append(f"field {key!r}, which the toolkit does not know")


def _allowed_operator(target: str) -> bool:
    """An ATen or prims operation other than FILE_OPERATIONS, a control-flow operator, or PYTHON_OPERATORS."""
    if target in PYTHON_OPERATORS:
        return True
    parts = target.split(".")
    if parts[:3] == ["torch", "ops", "higher_order"]:
        return len(parts) == 4 and parts[3] in CONTROL_FLOW
    if len(parts) != 5 or parts[:2] != ["torch", "ops"] or parts[2] not in OPERATOR_NAMESPACES:
        return False
    _, _, namespace, op, overload = parts
    if (not IDENTIFIER.fullmatch(op) or op.startswith("__") or op in FILE_OPERATIONS
            or not IDENTIFIER.fullmatch(overload) or overload.startswith("_")):
        return False
    try:  # the name torch's deserializer resolves by attribute lookups from `torch`: it must be an operation
        return isinstance(getattr(getattr(getattr(torch.ops, namespace), op), overload), torch._ops.OpOverload)
    except (AttributeError, RuntimeError):
        return False


def _plain_expression(text: str) -> bool:
    """A shape expression sympy may evaluate (SYMPY_FUNCTIONS, symbols, numbers, arithmetic): sympy turns any other
    string into code."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError):
        return False
    for node in ast.walk(tree):
        if not isinstance(node, SYMPY_NODES):
            return False
        if isinstance(node, ast.Name) and node.id not in SYMPY_FUNCTIONS | SYMPY_CONSTANTS \
                and not SYMBOL_NAME.fullmatch(node.id):
            return False
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in SYMPY_FUNCTIONS:
                return False
            if any(k.arg is None or not IDENTIFIER.fullmatch(k.arg) or k.arg.startswith("_") for k in node.keywords):
                return False
        if isinstance(node, ast.Constant) and not isinstance(node.value, (bool, int, float, str)):
            return False
    strings = [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    allowed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            first = node.args[0].value
            if node.func.id == "Symbol" and isinstance(first, str) and SYMBOL_NAME.fullmatch(first):
                allowed.add(id(node.args[0]))
            elif node.func.id == "Float" and isinstance(first, str) and NUMBER.fullmatch(first):
                allowed.add(id(node.args[0]))
    return all(id(node) in allowed for node in strings)


def _plain_tree_spec(text: str) -> bool:
    """A pytree spec (JSON) whose every string is a dotted name: kwargs' names go into the generated module's code."""
    try:
        spec = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    pending = [spec]
    while pending:
        item = pending.pop()
        if isinstance(item, dict):
            context = item.get("context")
            if isinstance(context, str):
                try:
                    pending.append(json.loads(context))
                except (json.JSONDecodeError, RecursionError):
                    return False
            pending += [value for key, value in item.items() if key != "context"]
            if not all(isinstance(key, str) and IDENTIFIER.fullmatch(key) for key in item):
                return False
        elif isinstance(item, list):
            pending += item
        elif isinstance(item, str) and not DOTTED_IDENTIFIER.fullmatch(item):
            return False
    return True


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
