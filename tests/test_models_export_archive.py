"""A model file runs no code unless trusted. A torch.export archive is read member by member before torch loads it
(`tools.models.export_archive`): each crafted archive here is one with which torch's own loader (or the module it
builds) runs code, shown by a marker file it writes, and the toolkit refuses it in one line with the marker still
absent, by every route a model file takes (in9_eval, challenge_eval, the zoo, benchmark(), train.py); with
--trust-checkpoint it loads. Both layouts torch reads are crafted: the archive of torch >= 2.7 (`<root>/models/...`,
`<root>/data/...`), and the older zip of top-level members that torch 2.6 writes and every later torch still
reads, whose weights, constants and example inputs torch unpickles in full. A TorchScript file is a program:
refused without --trust-checkpoint."""

from __future__ import annotations

import argparse
import io
import json
import logging
import operator
import pathlib
import pickle
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._export.serde.schema import SCHEMA_VERSION, Layout, ScalarType

import challenge_eval
import in9_eval
import train
from tests.helpers import check_error, files_read, run_in_process
from tools import benchmark, zoo
from tools.data import synthetic
from tools.errors import UserError
from tools.in9 import IMAGE_SIZE, Normalization
from tools.models.architectures import SMALL_CNN, build_architecture
from tools.models.checkpoints import read_checkpoint
from tools.models.export_archive import untrusted_content
from tools.models.record import ModelRecord
from tools.models.recorded import TRAINED_FORMAT
from tools.models.sources import load_model

CPU = torch.device("cpu")
IMAGES = torch.zeros(2, 3, IMAGE_SIZE, IMAGE_SIZE)


class Touch:
    """Unpickles by creating the file `path` (the harmless stand-in for any code)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


class TouchThen:
    """Unpickles as `value`, having created the file `path` first."""

    def __init__(self, path: Path, value):
        self.path, self.value = path, value

    def __reduce__(self):
        return operator.getitem, ((Touch(self.path), self.value), 1)


def pickled(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


ARCHIVE_PROGRAM = "models/model.json"  # the program in the archive layout (torch >= 2.7), under its root folder
ZIP_PROGRAM = "serialized_exported_program.json"  # in the older zip layout (torch 2.6), at the top level
ZIP_PICKLES = {"weights": "serialized_state_dict.pt", "constants": "serialized_constants.pt",
               "inputs": "serialized_example_inputs.pt"}


@pytest.fixture(scope="module")
def program() -> torch.export.ExportedProgram:
    """The hand-built colour model exported as the demo exports it (any batch size)."""
    return torch.export.export(synthetic.ColorEvidenceModel(9).eval(), (IMAGES,),
                               dynamic_shapes=({0: torch.export.Dim("batch", max=2**31 - 1)},))


@pytest.fixture(scope="module")
def exported(program, tmp_path_factory) -> Path:
    """The program in torch's own file (the archive layout from torch 2.7, the zip layout before)."""
    path = tmp_path_factory.mktemp("export") / "color.pt2"
    torch.export.save(program, str(path))
    return path


def save_zip(program: torch.export.ExportedProgram, path: Path) -> Path:
    """`program` in the older zip layout, as torch 2.6's torch.export.save writes it (its serializer's program
    JSON and pickles, top-level members): torch's own file at 2.6, the format later torch falls back to."""
    from torch._export.serde.serialize import serialize  # noqa: PLC0415 (torch's private serializer, here only)
    artifact = serialize(program)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(ZIP_PROGRAM, artifact.exported_program)
        archive.writestr(ZIP_PICKLES["weights"], artifact.state_dict)
        archive.writestr(ZIP_PICKLES["constants"], artifact.constants)
        archive.writestr(ZIP_PICKLES["inputs"], artifact.example_inputs)
        archive.writestr("version", ".".join(map(str, SCHEMA_VERSION)))
    return path


@pytest.fixture(scope="module")
def exported_zip(program, tmp_path_factory) -> Path:
    return save_zip(program, tmp_path_factory.mktemp("export") / "color-zip.pt2")


def layout(path: Path) -> str:
    """"zip" (torch 2.6's layout) or "archive" (that of torch >= 2.7)."""
    with zipfile.ZipFile(path) as archive:
        return "zip" if ZIP_PROGRAM in archive.namelist() else "archive"


def rewrite(source: Path, target: Path, edit) -> Path:
    """A copy of the archive `source` in which `edit(members)` changed, added or removed members
    ({name: bytes}, names without the archive layout's root folder; "/"-led names sit at the zip's top level)."""
    with zipfile.ZipFile(source) as archive:
        names = archive.namelist()
        root = "" if ZIP_PROGRAM in names else names[0].split("/")[0] + "/"
        members = {name[len(root):]: archive.read(name) for name in names}
    edit(members)
    with zipfile.ZipFile(target, "w") as archive:
        for name, data in members.items():
            archive.writestr(name[1:] if name.startswith("/") else f"{root}{name}", data)
    return target


def edit_program(change):
    """An edit of the program's JSON (models/model.json, or the zip layout's serialized_exported_program.json)
    by `change(program)`."""
    def edit(members):
        name = ARCHIVE_PROGRAM if ARCHIVE_PROGRAM in members else ZIP_PROGRAM
        program = json.loads(members[name])
        change(program)
        members[name] = json.dumps(program).encode()
    return edit


def edit_zip_pickle(kind: str, change, member: str | None = None):
    """An edit of one of the zip layout's pickles (`kind`: weights, constants or inputs) to `change(its value)`,
    stored as `member` (default: where torch 2.6 writes it)."""
    def edit(members):
        value = torch.load(io.BytesIO(members.pop(ZIP_PICKLES[kind])), weights_only=True)
        members[member or ZIP_PICKLES[kind]] = pickled(change(value))
    return edit


def edit_config(kind: str, change):
    def edit(members):
        name = f"data/{kind}/model_{kind}_config.json"
        config = json.loads(members[name])
        change(config["config"], members)
        members[name] = json.dumps(config).encode()
    return edit


def pickled_weight(marker):
    """The weights config marks a weight `use_pickle` (torch unpickles it with every global allowed)."""
    def change(config, members):
        fqn, meta = next(iter(config.items()))
        meta["use_pickle"] = True
        weight = torch.frombuffer(bytearray(members[f"data/weights/{meta['path_name']}"]), dtype=torch.float32)
        members[f"data/weights/{meta['path_name']}"] = pickled(TouchThen(marker, weight.reshape(1, 3, 1, 1)))
    return edit_config("weights", change)


def opaque_constant(marker):
    """A constant stored as an opaque Python object: plain pickle.loads."""
    def change(config, members):
        config["extra"] = {"path_name": "opaque_obj_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
        members["data/constants/opaque_obj_0"] = pickle.dumps(Touch(marker))
    return edit_config("constants", change)


def pickled_constant(marker):
    def change(config, members):
        config["extra"] = {"path_name": "tensor_9", "is_param": False, "use_pickle": True, "tensor_meta": None}
        members["data/constants/tensor_9"] = pickled(TouchThen(marker, torch.zeros(1)))
    return edit_config("constants", change)


def sample_inputs(marker):
    """The example inputs: torch tries weights_only, then falls back to full unpickling."""
    def edit(members):
        members["data/sample_inputs/model.pt"] = pickled(TouchThen(marker, ((IMAGES,), {})))
    return edit


def legacy_weights(marker):
    """A legacy `data/weights/model.pt` (torch 2.7's layout), read instead of the weights config."""
    def edit(members):
        members["data/weights/model.pt"] = pickled(TouchThen(marker, {}))
    return edit


def python_operator(marker):
    """A node whose target is any Python function reachable from `torch` (here os.mkdir): torch's deserializer
    resolves it, its verifier refuses it today (the one craft here that does not run with torch alone)."""
    def change(program):
        nodes = program["graph_module"]["graph"]["nodes"]
        nodes.insert(0, {"target": "torch.os.mkdir", "inputs": [
            {"name": "path", "arg": {"as_string": str(marker)}, "kind": 1}], "outputs": [], "metadata": {}})
    return edit_program(change)


def file_operation(marker):
    """ATen's own file operation: aten::from_file maps a file shared (creating it), fill_ writes into it."""
    def tensor(size):
        return {"dtype": ScalarType.BYTE.value, "sizes": [{"as_int": size}], "requires_grad": False,
                "device": {"type": "cpu", "index": None}, "strides": [{"as_int": 1}],
                "storage_offset": {"as_int": 0}, "layout": Layout.Strided.value}

    def change(program):
        graph = program["graph_module"]["graph"]
        graph["nodes"][:0] = [
            {"target": "torch.ops.aten.from_file.default", "name": "mapped", "metadata": {},
             "inputs": [{"name": "filename", "arg": {"as_string": str(marker)}, "kind": 1},
                        {"name": "shared", "arg": {"as_bool": True}, "kind": 1},
                        {"name": "size", "arg": {"as_int": 6}, "kind": 1},
                        {"name": "dtype", "arg": {"as_scalar_type": ScalarType.BYTE.value}, "kind": 2}],
             "outputs": [{"as_tensor": {"name": "mapped"}}]},
            {"target": "torch.ops.aten.fill_.Scalar", "name": "filled", "metadata": {},
             "inputs": [{"name": "self", "arg": {"as_tensor": {"name": "mapped"}}, "kind": 1},
                        {"name": "value", "arg": {"as_int": 88}, "kind": 1}],
             "outputs": [{"as_tensor": {"name": "filled"}}]}]
        graph["tensor_values"].update(mapped=tensor(6), filled=tensor(6))
        program["verifiers"] = ["TRAINING"]
    return edit_program(change)


def guard_code(marker):
    """`guards_code`: Python that the module runs on every call."""
    def change(program):
        program["guards_code"] = [f"__import__('pathlib').Path({str(marker)!r}).touch() is None"]
    return edit_program(change)


def shape_expression(marker):
    """A shape expression, which torch gives sympy to evaluate."""
    def change(program):
        size = program["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0]["as_expr"]
        size["expr_str"] = (f"Add({size['expr_str']}, "
                            f"0*int(__import__('pathlib').Path({str(marker)!r}).touch() is None))")
    return edit_program(change)


def buffer_name(marker):
    """A buffer's name, which becomes an attribute access in the module's generated code."""
    evil = f'forward") and getattr(__import__("os"), "mkdir")("{marker}") or getattr(self, "forward'

    def rename(program):
        for spec in program["graph_module"]["signature"]["input_specs"]:
            if spec.get("buffer", {}).get("buffer_name") == "mean":
                spec["buffer"]["buffer_name"] = evil

    def weights(state):
        state[evil] = state.pop("mean")
        return state

    def edit(members):
        edit_program(rename)(members)
        if ZIP_PROGRAM in members:
            edit_zip_pickle("weights", weights)(members)
        else:
            edit_config("weights", lambda config, _: weights(config))(members)
    return edit


def input_name(marker):
    """An input's name, which becomes a parameter (and its default value) in the generated code."""
    evil = f"x=getattr(__import__('os'), 'mkdir')({str(marker)!r})"
    def edit(members):
        name = ARCHIVE_PROGRAM if ARCHIVE_PROGRAM in members else ZIP_PROGRAM
        program = json.loads(members[name].decode().replace('{"name": "x"}', json.dumps({"name": evil})))
        values = program["graph_module"]["graph"]["tensor_values"]
        values[evil] = values.pop("x")
        members[name] = json.dumps(program).encode()
    return edit


def compiled_code(marker):
    """An AOTInductor folder: a shared library torch would load."""
    def edit(members):
        members["data/aotinductor/model/model.so"] = b"\x7fELF"
    return edit


def old_format(marker):
    """The format of torch 2.6 and before (top-level members, read with zipfile), its state dict a pickle."""
    def edit(members):
        program = members["models/model.json"]
        members.clear()
        members["/version"] = ".".join(map(str, SCHEMA_VERSION)).encode()
        members["/serialized_exported_program.json"] = program
        members["/serialized_state_dict.pt"] = pickled(TouchThen(marker, {}))
        members["/serialized_constants.pt"] = pickled({})
        members["/serialized_example_inputs.pt"] = pickled(((IMAGES,), {}))
    return edit


def zip_pickled_weights(marker):
    """The zip layout's state dict, which torch unpickles with every global allowed (weights_only=False)."""
    return edit_zip_pickle("weights", lambda state: TouchThen(marker, state))


def zip_pickled_constants(marker):
    return edit_zip_pickle("constants", lambda constants: TouchThen(marker, constants))


def zip_sample_inputs(marker):
    return edit_zip_pickle("inputs", lambda inputs: TouchThen(marker, inputs))


def zip_json_weights(marker):
    """The state dict under its deprecated name, serialized_state_dict.json: torch unpickles it the same."""
    return edit_zip_pickle("weights", lambda state: TouchThen(marker, state), "serialized_state_dict.json")


PROGRAM_CRAFTS = {"python operator": python_operator, "file operation": file_operation, "guard code": guard_code,
                  "shape expression": shape_expression, "buffer name": buffer_name, "input name": input_name}
CRAFTS = {"archive": {"pickled weight": pickled_weight, "opaque object": opaque_constant,
                      "pickled constant": pickled_constant, "sample inputs": sample_inputs,
                      "legacy weights": legacy_weights, "compiled code": compiled_code, "old format": old_format,
                      **PROGRAM_CRAFTS},
          "zip": {"pickled weights": zip_pickled_weights, "pickled constants": zip_pickled_constants,
                  "sample inputs": zip_sample_inputs, "json weights": zip_json_weights, **PROGRAM_CRAFTS}}
ZIP_PICKLE_CRAFTS = ("pickled weights", "pickled constants", "sample inputs", "json weights")
WORDS = {"pickled weight": "pickled weight 'mean'", "opaque object": "pickled Python object constant 'extra'",
         "pickled constant": "pickled constant 'extra'", "sample inputs": "weights-only",
         "legacy weights": "weights-only", "python operator": "operator 'torch.os.mkdir'",
         "file operation": "operator 'torch.ops.aten.from_file.default'", "guard code": "guard code",
         "shape expression": "shape expression", "buffer name": "name 'forward\")", "input name": "name \"x=",
         "compiled code": "AOTInductor", "old format": "serialized_state_dict.pt",
         "pickled weights": "weights-only unpickling (serialized_state_dict.pt)",
         "pickled constants": "weights-only unpickling (serialized_constants.pt)",
         "json weights": "weights-only unpickling (serialized_state_dict.json)"}


def crafted_source(form: str, exported: Path, exported_zip: Path) -> Path:
    """The file a craft of the layout `form` starts from: the zip layout at every torch, the archive layout where
    torch writes it."""
    if form == "zip":
        return exported_zip
    if layout(exported) != "archive":
        pytest.skip(f"torch {torch.__version__} writes and reads the zip layout only (the archive layout is torch "
                    f"2.7's)")
    return exported


@pytest.mark.parametrize(("form", "craft"), [(form, craft) for form, crafts in CRAFTS.items() for craft in crafts])
@pytest.mark.slow
def test_a_crafted_export_archive_is_refused_before_it_runs(form, craft, exported, exported_zip, tmp_path):
    marker = tmp_path / "marker"
    path = rewrite(crafted_source(form, exported, exported_zip), tmp_path / "crafted.pt2", CRAFTS[form][craft](marker))
    with pytest.raises(UserError, match="--trust-checkpoint") as caught:
        read_checkpoint(path, None, None, Normalization.AUTO, False, None, CPU, ModelRecord())
    assert WORDS[craft] in str(caught.value)
    assert "\n" not in str(caught.value)
    assert not marker.exists()


@pytest.mark.parametrize("craft", ZIP_PICKLE_CRAFTS)
def test_torch_unpickles_the_zip_layouts_pickles_in_full(craft, exported_zip, tmp_path, caplog):
    """The zip layout's crafts are live at every torch: its loader (torch 2.6's, later torch's fallback) unpickles
    the state dict, constants and example inputs with weights_only=False, so their code runs. (torch 2.14's warning
    that it fell back has one argument for two placeholders: under pytest's log capture, which raises a logging
    error, it would end the load before the craft is seen to run, so torch's export loggers are quiet here.)"""
    caplog.set_level(logging.ERROR, logger="torch._export")
    caplog.set_level(logging.ERROR, logger="torch.export")
    marker = tmp_path / "marker"
    path = rewrite(exported_zip, tmp_path / "crafted.pt2", CRAFTS["zip"][craft](marker))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.load(str(path))
    assert marker.exists()


def test_real_exports_are_data(exported, exported_zip, tmp_path):
    """What torch writes for ordinary classifiers passes: a dynamic batch, kwargs, no_grad in forward (a
    higher-order operator with a subgraph), submodules in lists, lifted constants, decomposed to core ATen."""
    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([build_architecture(SMALL_CNN, 9)])

        def forward(self, x, scale=None):
            with torch.no_grad():
                logits = self.blocks[0](x)
            return logits.reshape(x.shape[0], -1) * (torch.tensor([2.0]) if scale is None else scale)

    program = torch.export.export(Classifier().eval(), (IMAGES,), kwargs={"scale": torch.ones(1)},
                                  dynamic_shapes={"x": {0: torch.export.Dim("batch")}, "scale": None})
    for name, version in (("training", program), ("core", program.run_decompositions())):
        torch.export.save(version, str(tmp_path / f"{name}.pt2"))
        assert untrusted_content(tmp_path / f"{name}.pt2") == []
        assert untrusted_content(save_zip(version, tmp_path / f"{name}-zip.pt2")) == []  # torch 2.6's layout
    assert untrusted_content(exported) == [] and untrusted_content(exported_zip) == []


@pytest.fixture
def weight_pickle(exported, tmp_path) -> tuple[Path, Path, str]:
    """(torch's own file with a pickled weight, the marker its unpickling creates, what the refusal names)."""
    marker = tmp_path / "marker"
    form = layout(exported)
    craft = "pickled weight" if form == "archive" else "pickled weights"
    return rewrite(exported, tmp_path / "pickled.pt2", CRAFTS[form][craft](marker)), marker, WORDS[craft]


@pytest.mark.parametrize("script", [in9_eval, challenge_eval])
def test_the_scripts_refuse_it_and_trust_loads_it(script, weight_pickle, dataset, tmp_path, capsys):
    path, marker, words = weight_pickle
    common = ["--data-path", str(dataset.root), "--checkpoint", str(path), "--device", "cpu", "--no-progress",
              "--no-cache", "--log-level", "ERROR", "--output-dir", str(tmp_path / "out")]
    line = check_error(*run_in_process(script.main, common, capsys))
    assert words in line and "--trust-checkpoint" in line
    assert not marker.exists()
    if script is in9_eval:  # the flag the message names: torch's loader, the file's code included
        code, out, err = run_in_process(script.main, [*common, "--trust-checkpoint"], capsys)
        assert code == 0, err
        assert "Accuracy on original is" in out
        assert marker.exists()


@pytest.mark.slow
def test_the_zoo_refuses_it(weight_pickle, dataset, tmp_path, capsys):
    path, marker, words = weight_pickle
    code, out, err = run_in_process(zoo.main, ["--data-path", str(dataset.root), "--models", f"file:{path}",
                                               "--output-dir", str(tmp_path / "zoo"), "--device", "cpu",
                                               "--no-progress", "--no-cache"], capsys)
    assert code != 0
    assert words in err and "--trust-checkpoint" in err
    assert not marker.exists()


def test_benchmark_refuses_it(weight_pickle, dataset):
    path, marker, words = weight_pickle
    with pytest.raises(UserError, match="trust_checkpoint=True") as caught:
        benchmark(f"file:{path}", dataset.root, device="cpu", progress=False, cache=False)
    assert words in str(caught.value)
    assert not marker.exists()


def test_train_refuses_it(weight_pickle, tiny, tmp_path, capsys):
    path, marker, words = weight_pickle
    line = check_error(*run_in_process(train.main, ["--data-path", str(tiny), "--arch", f"file:{path}",
                                                     "--output-dir", str(tmp_path / "run"), "--device", "cpu",
                                                     "--batch-size", "4", "--no-progress", "--log-level", "ERROR"],
                                        capsys))
    assert words in line
    assert not marker.exists()


class OverwritesAFile(nn.Module):
    """A scripted classifier whose forward maps a file shared and overwrites it (and predicts from its first
    byte): the file is named in its code, outside every folder a run is given."""

    def __init__(self, victim: str):
        super().__init__()
        self.victim = victim

    def forward(self, x):
        mapped = torch.from_file(self.victim, shared=True, size=6, dtype=torch.uint8)
        first = mapped[0].float()
        mapped.fill_(88)
        return torch.zeros(x.shape[0], 9) + first


def test_a_torchscript_file_needs_trust(dataset, tmp_path, capsys):
    victim = tmp_path / "elsewhere" / "notes.txt"
    victim.parent.mkdir()
    victim.write_text("secret")
    path = tmp_path / "model.ts"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.save(torch.jit.script(OverwritesAFile(str(victim))), str(path))
    common = ["--data-path", str(dataset.root), "--checkpoint", str(path), "--device", "cpu", "--no-progress",
              "--no-cache", "--log-level", "ERROR", "--output-dir", str(tmp_path / "out")]
    line = check_error(*run_in_process(in9_eval.main, common, capsys))
    assert "TorchScript program" in line and "--trust-checkpoint" in line and "torch.export" in line
    assert victim.read_text() == "secret"
    code, out, err = run_in_process(in9_eval.main, [*common, "--trust-checkpoint"], capsys)  # trusted: it runs
    assert code == 0, err
    assert "Accuracy on original is" in out
    assert victim.read_text() == "X" * 6


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def evil_weights(exported: Path, marker: Path) -> tuple[dict[str, bytes], dict[str, bytes], str]:
    """(the archive's members, the same with its weights config marking a weight `use_pickle` and that weight a
    pickle that creates `marker`, the config's name), names with the root folder."""
    with zipfile.ZipFile(exported) as archive:
        good = {name: archive.read(name) for name in archive.namelist()}
    evil = dict(good)
    rewrite_members = {name.partition("/")[2]: data for name, data in good.items()}
    pickled_weight(marker)(rewrite_members)
    root = next(iter(good)).partition("/")[0]
    evil.update({f"{root}/{name}": data for name, data in rewrite_members.items()})
    return good, evil, f"{root}/data/weights/model_weights_config.json"


def case_variant(exported: Path, target: Path, marker: Path) -> Path:
    """Beside the weights config, one whose name differs only in case, marking a weight pickled: torch's zip reader
    (miniz) finds a member by its name in any case and reads this one."""
    good, evil, config = evil_weights(exported, marker)
    members = {}
    for name, data in good.items():
        members[name] = data
        if name == config:
            members[config[:-len("json")] + "JSON"] = evil[config]
    members.update({name: data for name, data in evil.items() if name not in good or data != good[name]
                    and name != config})
    target.write_bytes(zip_bytes(members))
    return target


def two_directories(exported: Path, target: Path, marker: Path) -> Path:
    """One file, two zip directories: Python's zipfile reads the directory just before the end record (taking the
    bytes before the archive for a prefix), torch's reader the one the end record's offset names. Python's view is
    the plain archive, torch's the archive with a pickled weight."""
    good, evil, _ = evil_weights(exported, marker)

    def parts(data: bytes) -> tuple[bytes, bytearray, bytearray]:
        end = data.rfind(b"PK\x05\x06")
        size, offset = struct.unpack("<II", data[end + 12:end + 20])
        return data[:offset], bytearray(data[offset:offset + size]), bytearray(data[end:])

    evil_body, evil_directory, _ = parts(zip_bytes(evil))
    good_body, good_directory, end_record = parts(zip_bytes(good))
    assert len(evil_directory) == len(good_directory)  # the same names: the end record's size fits both
    evil_at = len(evil_body)
    good_start = evil_at + len(evil_directory)
    prefix = good_start + len(good_body) - evil_at  # what Python takes for bytes before the archive
    at = 0
    while at < len(good_directory):  # the plain archive's offsets, as Python adds the prefix to them
        name_length, extra_length, comment_length = struct.unpack("<HHH", good_directory[at + 28:at + 34])
        offset, = struct.unpack("<I", good_directory[at + 42:at + 46])
        good_directory[at + 42:at + 46] = struct.pack("<I", good_start + offset - prefix)
        at += 46 + name_length + extra_length + comment_length
    end_record[16:20] = struct.pack("<I", evil_at)
    target.write_bytes(evil_body + evil_directory + good_body + good_directory + end_record)
    return target


@pytest.mark.parametrize("craft", [case_variant, two_directories])
def test_the_archive_is_checked_as_torch_reads_it(craft, exported, tmp_path):
    """Members torch's zip reader finds where Python's zipfile sees other ones are checked as torch reads them (the
    archive was passed as data, then torch's loader unpickled the weight)."""
    if layout(exported) != "archive":
        pytest.skip(f"torch {torch.__version__} reads an export archive with Python's zipfile alone (the archive "
                    f"layout, read with torch's own zip reader as well, is torch 2.7's)")
    marker = tmp_path / "marker"
    path = craft(exported, tmp_path / "crafted.pt2", marker)
    with pytest.raises(UserError, match="--trust-checkpoint") as caught:
        read_checkpoint(path, None, None, Normalization.AUTO, False, None, CPU, ModelRecord())
    assert "\n" not in str(caught.value)
    assert not marker.exists()
    with warnings.catch_warnings():  # the craft is live: torch's own loader runs it
        warnings.simplefilter("ignore")
        torch.export.load(str(path))
    assert marker.exists()


def trained_checkpoint(model: nn.Module, arguments: dict, path: Path) -> None:
    """train.py's checkpoint of timm's test_resnet, recording `arguments` as its builder's."""
    torch.save({"format": TRAINED_FORMAT, "arch": "timm:test_resnet", "num_classes": 9, "arch_args": arguments,
                "input_size": [160, 160], "interpolation": "bilinear", "mean": [0.5] * 3, "std": [0.5] * 3,
                "model": model.state_dict(), "method": "erm", "data": {}, "train_args": {}, "precision": "fp32"}, path)


def timm_training_checkpoint(model: nn.Module, arguments: dict, path: Path) -> None:
    """timm's train.py's checkpoint of test_resnet, whose `--model-kwargs` were `arguments`."""
    torch.save({"arch": "test_resnet", "state_dict": model.state_dict(), "version": 2, "epoch": 0,
                "args": argparse.Namespace(model="test_resnet", num_classes=9, model_kwargs=arguments)}, path)


@pytest.mark.parametrize("writer", [trained_checkpoint, timm_training_checkpoint])
def test_builder_arguments_a_checkpoint_records_open_no_file(writer, tmp_path):
    """A checkpoint records its builder's arguments (a ViT's image size, timm's global pool and `--model-kwargs`):
    one that makes the builder load weights is refused before the builder runs, such as timm's checkpoint_path,
    with which timm.create_model read a file the checkpoint named, anywhere."""
    timm = pytest.importorskip("timm")
    if "test_resnet" not in timm.list_models():
        pytest.skip(f"timm {timm.__version__} has no test_resnet")
    model = timm.create_model("test_resnet", num_classes=9)
    elsewhere = tmp_path / "elsewhere" / "weights.pth"
    elsewhere.parent.mkdir()
    torch.save(model.state_dict(), elsewhere)
    path = tmp_path / "checkpoint.pt"
    writer(model, {"checkpoint_path": str(elsewhere)}, path)
    with files_read() as read, pytest.raises(UserError, match="checkpoint_path") as caught:
        read_checkpoint(path, None, None, Normalization.AUTO, False, None, CPU, ModelRecord())
    assert "\n" not in str(caught.value)
    assert [opened for opened in read if opened.is_relative_to(elsewhere.parent)] == []


# ----------------------------------------------------------------------------------------------------------
# torch's weights_only default reversed (TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD)

def pickled_file(route: str, folder: Path, marker: Path) -> str:
    """A model of `route` whose weights file is a pickle that makes `marker` when unpickled in full; its name."""
    from tests.test_models_hub import Exploit  # noqa: PLC0415
    exploit = {"x": Exploit(str(marker))}
    if route == "checkpoint":
        torch.save(exploit, folder / "weights.pt")
        return f"file:{folder / 'weights.pt'}"
    if route == "clip":
        from tests.helpers import TINY_CLIP, TINY_CLIP_OPTIONS  # noqa: PLC0415
        torch.save(exploit, folder / "clip.pt")
        return f"clip:{TINY_CLIP}/{folder / 'clip.pt'}{TINY_CLIP_OPTIONS}"
    if route == "hf":
        from tests.test_models_hub import save_vit  # noqa: PLC0415
        save_vit(folder / "vit", None, seed=0, num_labels=9)
        (folder / "vit" / "model.safetensors").unlink()
        torch.save(exploit, folder / "vit" / "pytorch_model.bin")
        return f"hf:{folder / 'vit'}"
    peft = pytest.importorskip("peft")  # an adapter folder's adapter_model.bin
    model = peft.get_peft_model(build_architecture(SMALL_CNN, 9), peft.LoraConfig(r=2, target_modules=["fc"]))
    model.save_pretrained(folder / "adapter", safe_serialization=False)
    torch.save(exploit, folder / "adapter" / "adapter_model.bin")
    torch.save(build_architecture(SMALL_CNN, 9).state_dict(), folder / "base.pt")
    return f"{SMALL_CNN}@file:{folder / 'base.pt'}@file:{folder / 'adapter'}"


@pytest.mark.parametrize("route", ["checkpoint", "clip", "hf", "adapter"])
def test_a_pickle_with_code_is_refused_with_torchs_default_reversed(route, tmp_path, monkeypatch, request):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 makes torch unpickle in full wherever a caller does not say weights_only:
    every reader of a model file says it (open_clip before 2.27 did not, so a local CLIP weights file's code ran
    there); without --trust-checkpoint such a file is refused in one line, its code unrun."""
    if route == "clip":
        request.getfixturevalue("tiny_clip")
    if route == "hf":
        request.getfixturevalue("hub_cache")
    marker = tmp_path / "unpickled"
    name = pickled_file(route, tmp_path, marker)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UserError) as refused:
        load_model(name)
    assert "\n" not in str(refused.value) and not marker.exists()
