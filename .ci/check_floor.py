"""The declared floor, checked: the test suite in a virtual environment at pyproject.toml's lowest versions.

    python .ci/check_floor.py [--python PYTHON3.10] [--venv DIR]

Every direct requirement (the dependencies and every extra's) is installed at exactly its declared lower bound,
with the lowest Python that `requires-python` allows; everything else resolves as pip resolves it for a user
(the newest releases that fit). Then the README's test command runs there. When it passes, the environment is
written to .ci/floor.txt, which tests/test_floor.py holds against pyproject.toml: a floor that is raised or
lowered without this check fails the suite. Run this script with Python >= 3.11 (or with `tomli` installed).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency tomli is the same parser
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
RECORD = ROOT / ".ci" / "floor.txt"
PYTHON = "python"  # the record's name for the interpreter, beside the packages
RESULT_PREFIX = "# pytest: "
# the README's test command; the check of this record is left out, as the record is what the run will write
TEST_COMMAND = ("-m", "pytest", "-q",
                "--deselect", "tests/test_floor.py::test_the_recorded_floor_is_the_declared_floor")

REQUIREMENT = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*([^;]*)")


class FloorError(Exception):
    """The floor cannot be read, installed exactly, or the suite fails there."""


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version, trailing zeros dropped, so that "2.6" and "2.6.0+cpu" are equal."""
    parts = [int(p) for p in re.match(r"\d+(?:\.\d+)*", version).group(0).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _floor(spec: str, what: str) -> str:
    bounds = [s.strip()[2:].strip() for s in spec.split(",") if s.strip().startswith(">=")]
    if len(bounds) != 1:
        raise FloorError(f"{what} {spec!r} needs one lower bound `>=X`: the floor is what this check installs")
    return bounds[0]


def _pyproject(path: Path) -> dict:
    with open(path, "rb") as f:
        return tomllib.load(f)["project"]


def declared_floors(path: Path = PYPROJECT) -> dict[str, str]:
    """{canonical name: lowest version} of every direct requirement, the extras' included."""
    project = _pyproject(path)
    lists = [project.get("dependencies", []), *project.get("optional-dependencies", {}).values()]
    floors: dict[str, str] = {}
    for requirement in (r for lst in lists for r in lst):
        name, spec = REQUIREMENT.match(requirement).groups()  # (environment markers, after ";", aside)
        if canonical(name) == canonical(project.get("name", "")):  # an extra made of this project's others
            continue
        floor = _floor(spec, f"requirement {name}")
        previous = floors.setdefault(canonical(name), floor)
        if release(previous) != release(floor):
            raise FloorError(f"{name} has two floors, {previous} and {floor}; one version is the tested one")
    return floors


def python_floor(path: Path = PYPROJECT) -> str:
    """The lowest Python `requires-python` allows, such as "3.10"."""
    return _floor(_pyproject(path)["requires-python"], "requires-python")


def extras(path: Path = PYPROJECT) -> list[str]:
    return sorted(_pyproject(path).get("optional-dependencies", {}))


@dataclass
class Record:
    """The environment of the last passing floor check: {canonical name: version}, Python under "python"."""
    versions: dict[str, str]
    result: str  # pytest's summary, such as "301 passed, 11 skipped"


def read_record(path: Path = RECORD) -> Record:
    versions, result = {}, ""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(RESULT_PREFIX):
            result = line[len(RESULT_PREFIX):]
        elif line and not line.startswith("#"):
            name, version = line.split("==")
            versions[canonical(name)] = version
    return Record(versions, result)


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("+", " ".join(command), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def _summary(output: str) -> str:
    """pytest -q's last line without its timing: "301 passed, 11 skipped"."""
    last = output.strip().splitlines()[-1].strip("= ")
    return re.sub(r"\s+in [\d.]+s.*$", "", last)


def read_versions(frozen: str) -> dict[str, str]:
    """{canonical name: version} from `pip freeze` lines."""
    pairs = (line.split("==") for line in frozen.splitlines() if "==" in line)
    return {canonical(name): version for name, version in pairs}


def check(python: str, venv: Path) -> Record:
    """Build (or bring to the floor) the environment in `venv`, run the suite there, and return its record."""
    floors = declared_floors()
    if not (venv / "bin" / "python").exists():
        _run([python, "-m", "venv", str(venv)])
    venv_python = str(venv / "bin" / "python")
    version = _run([venv_python, "-c", "import platform; print(platform.python_version())"],
                   capture_output=True, text=True).stdout.strip()
    if release(version)[:2] != release(python_floor()):
        raise FloorError(f"{python} is Python {version}, not the declared floor {python_floor()}; pass --python")
    constraints = venv / "floor-constraints.txt"
    constraints.write_text("".join(f"{name}=={floor}\n" for name, floor in sorted(floors.items())))
    _run([venv_python, "-m", "pip", "install", "-c", str(constraints), "-e", f".[{','.join(extras())}]"], cwd=ROOT)
    frozen = _run([venv_python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True).stdout
    installed = read_versions(frozen)
    wrong = {n: installed.get(n) for n, v in floors.items() if release(installed.get(n, "0")) != release(v)}
    if wrong:
        raise FloorError(f"not installed at their floors: {wrong}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's editable install of this checkout
    print("+", venv_python, *TEST_COMMAND, flush=True)
    output = []
    with subprocess.Popen([venv_python, *TEST_COMMAND], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as tests:
        for line in tests.stdout:
            print(line, end="", flush=True)
            output.append(line)
    if tests.returncode != 0:
        raise FloorError(f"the suite fails at the floor ({_summary(''.join(output))}); {RECORD.name} is unchanged")
    return Record({PYTHON: version, **installed}, _summary("".join(output)))


def write_record(record: Record, path: Path = RECORD) -> None:
    lines = ["# Written by `python .ci/check_floor.py`: the environment in which the test suite last passed with every",
             "# direct requirement of pyproject.toml at its lowest declared version (the others as pip resolved",
             "# them). tests/test_floor.py checks that these are pyproject.toml's floors.",
             f"{RESULT_PREFIX}{record.result}"]
    lines += [f"{name}=={version}" for name, version in sorted(record.versions.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", metavar="PATH",
                        help="the interpreter to build the environment with (default: pythonX.Y on PATH, X.Y being "
                             "requires-python's floor)")
    parser.add_argument("--venv", metavar="DIR", type=Path,
                        help="build (or reuse) the environment there and keep it (default: a temporary folder, "
                             "removed afterwards)")
    args = parser.parse_args(argv)
    python = args.python or shutil.which(f"python{python_floor()}")
    if python is None:
        parser.error(f"no python{python_floor()} on PATH; pass --python PATH to a Python {python_floor()}")
    try:
        if args.venv is not None:
            record = check(python, args.venv)
        else:
            with tempfile.TemporaryDirectory(prefix="floor-venv-") as folder:
                record = check(python, Path(folder))
    except (FloorError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_record(record)
    print(f"floor check passed ({record.result}); wrote {RECORD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
