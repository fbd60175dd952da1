"""The declared range is the tested range at its floor: pyproject.toml's lowest versions (every direct
requirement, the extras' included, and Python) are those of the environment in which `.ci/check_floor.py`
last saw the whole suite pass, recorded in .ci/floor.txt."""

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
