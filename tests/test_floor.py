"""The declared range is the tested range at both ends: pyproject.toml's lowest versions (every direct
requirement, the extras' included, and Python) are those of the environment in which `.ci/check_floor.py`
last saw the whole suite pass, recorded in .ci/floor.txt; the Pythons its classifiers declare run from that
floor to the newest, with which `.ci/check_floor.py --newest` last saw the whole suite pass, recorded in
.ci/newest.txt."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def floor():
    yield load_script(ROOT / ".ci" / "check_floor.py")
    sys.modules.pop("check_floor", None)


def test_every_requirement_declares_one_floor(floor):
    """A requirement without a lower bound, or with two different ones in two extras, has no tested floor."""
    floors = floor.declared_floors()
    assert {"torch", "torchvision", "numpy", "pillow", "tqdm", "pytest", "peft", "open-clip-torch"} <= set(floors)
    assert floor.python_floor()


def test_the_recorded_floor_is_the_declared_floor(floor):
    record = floor.read_record()
    assert record.result and "failed" not in record.result and "error" not in record.result, record.result
    assert floor.release(record.versions[floor.PYTHON])[:2] == floor.release(floor.python_floor())
    for name, declared in floor.declared_floors().items():
        recorded = record.versions.get(name)
        assert recorded is not None and floor.release(recorded) == floor.release(declared), (
            f"pyproject.toml declares {name}>={declared}, but the suite last passed at the floor with {name} "
            f"{recorded}: run `python .ci/check_floor.py` (docs/how-it-works.md, Supported versions)")


def test_floors_are_read_as_pip_compares_them(floor, tmp_path):
    """Names compare as pip compares them, versions by their release; a missing or doubled floor is refused."""
    assert floor.canonical("Open_Clip.torch") == "open-clip-torch"
    assert floor.release("2.6") == floor.release("2.6.0+cu124") != floor.release("2.6.1")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "bgc"\nrequires-python = ">=3.10"\n'
                         'dependencies = ["torch>=2.6", "Pillow >= 10"]\n[project.optional-dependencies]\n'
                         'x = ["peft>=0.14,<0.22"]\ny = ["peft>=0.14.0", "a[b]>=1"]\nall = ["bgc[x,y]"]\n')
    assert floor.declared_floors(pyproject) == {"torch": "2.6", "pillow": "10", "peft": "0.14", "a": "1"}
    for requirements, problem in ((['"torch"'], "needs one lower bound"), (['"torch<3"'], "needs one lower bound"),
                                  (['"peft>=0.14"', '"peft>=0.15"'], "two floors")):
        pyproject.write_text(f'[project]\ndependencies = [{", ".join(requirements)}]\n')
        with pytest.raises(floor.FloorError, match=problem):
            floor.declared_floors(pyproject)


def test_the_declared_pythons_run_from_the_floor_to_the_newest(floor):
    """The classifiers name every minor version from requires-python's floor (the floor check's Python) to the
    newest, with no gap: the range a user reads is the range between the two recorded runs."""
    pythons = floor.declared_pythons()
    assert (pythons[0] == floor.python_floor()
            == ".".join(map(str, floor.release(floor.read_record().versions["python"])[:2])))
    minors = [floor.release(p)[1] for p in pythons]
    assert minors == list(range(minors[0], minors[-1] + 1)), pythons


def test_the_recorded_newest_python_is_the_declared_newest(floor):
    path = floor.NEWEST_RECORD
    assert path.is_file(), (f"no record of a run with the newest declared Python ({floor.python_newest()}): run "
                            f"`python .ci/check_floor.py --newest` (docs/how-it-works.md, Supported versions)")
    record = floor.read_record(path)
    assert record.result and "failed" not in record.result and "error" not in record.result, record.result
    assert floor.release(record.versions[floor.PYTHON])[:2] == floor.release(floor.python_newest()), (
        f"pyproject.toml's classifiers declare Python {floor.python_newest()} as the newest, but the suite last "
        f"passed with Python {record.versions[floor.PYTHON]}: run `python .ci/check_floor.py --newest`")


def test_the_declared_pythons_are_read_from_the_classifiers(floor, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nrequires-python = ">=3.10"\nclassifiers = ["Programming Language :: Python :: 3",'
                         ' "Programming Language :: Python :: 3.13", "Programming Language :: Python :: 3.10",'
                         ' "Programming Language :: Python :: 3 :: Only", "License :: OSI Approved"]\n')
    assert floor.declared_pythons(pyproject) == ["3.10", "3.13"] and floor.python_newest(pyproject) == "3.13"
    pyproject.write_text('[project]\nrequires-python = ">=3.10"\n')
    with pytest.raises(floor.FloorError, match="declares no"):
        floor.python_newest(pyproject)


def test_each_check_leaves_out_only_the_check_of_the_record_it_writes(floor):
    """A run that writes a record cannot pass that record's check beforehand; it runs every other test."""
    assert set(floor.RECORD_TESTS) == {floor.RECORD, floor.NEWEST_RECORD}
    for _path, test in floor.RECORD_TESTS.items():
        name = test.split("::")[1]
        assert name in globals() and test.startswith("tests/test_floor.py::")
