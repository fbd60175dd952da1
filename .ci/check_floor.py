"""The declared range, checked at both ends: the test suite in a virtual environment at pyproject.toml's lowest
versions, or (--newest) at the newest releases with the newest Python it declares.

    python .ci/check_floor.py [--python PYTHON3.10] [--venv DIR]
    python .ci/check_floor.py --newest [--python PYTHON3.13] [--venv DIR]

The floor: every direct requirement (the dependencies and every extra's) is installed at exactly its declared
lower bound, with the lowest Python that `requires-python` allows; everything else resolves as pip resolves it
for a user (the newest releases that fit). The newest end: the project with every extra, as pip resolves it
today, with the newest Python of the `Programming Language :: Python :: 3.X` classifiers. Then the README's
test command runs there. When it passes, the environment is written to .ci/floor.txt (or .ci/newest.txt),
which tests/test_floor.py holds against pyproject.toml: a floor, or a newest Python, declared without this
check fails the suite. Run this script with Python >= 3.11 (or with `tomli` installed).
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
NEWEST_RECORD = ROOT / ".ci" / "newest.txt"
PYTHON = "python"  # the record's name for the interpreter, beside the packages
RESULT_PREFIX = "# pytest: "
# the README's test command; the check of the record a run writes is left out, as the record is what it will write
TEST_COMMAND = ("-m", "pytest", "-q")
RECORD_TESTS = {RECORD: "tests/test_floor.py::test_the_recorded_floor_is_the_declared_floor",
                NEWEST_RECORD: "tests/test_floor.py::test_the_recorded_newest_python_is_the_declared_newest"}
PYTHON_CLASSIFIER = re.compile(r"Programming Language :: Python :: (3\.\d+)$")

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


def declared_pythons(path: Path = PYPROJECT) -> list[str]:
    """The Python versions the `Programming Language :: Python :: 3.X` classifiers declare, oldest first."""
    found = [m.group(1) for c in _pyproject(path).get("classifiers", []) if (m := PYTHON_CLASSIFIER.match(c))]
    return sorted(found, key=release)


def python_newest(path: Path = PYPROJECT) -> str:
    """The newest Python the classifiers declare, such as "3.13"."""
    pythons = declared_pythons(path)
    if not pythons:
        raise FloorError("pyproject.toml declares no `Programming Language :: Python :: 3.X` classifier: the newest "
                         "Python supported is the newest one run")
    return pythons[-1]


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


def declared_python(newest: bool) -> str:
    """The Python a check runs with: the newest the classifiers declare, or requires-python's floor."""
    return python_newest() if newest else python_floor()


def prepare(python: str, venv: Path, newest: bool = False) -> tuple[str, dict[str, str]]:
    """Build (or bring up to date) the environment in `venv`: the project with every extra, at the floors or
    (`newest`) as pip resolves it today; (its python, {canonical name: version} of what is installed)."""
    if not (venv / "bin" / "python").exists():
        _run([python, "-m", "venv", str(venv)])
    venv_python = str(venv / "bin" / "python")
    version = _run([venv_python, "-c", "import platform; print(platform.python_version())"],
                   capture_output=True, text=True).stdout.strip()
    wanted = declared_python(newest)
    if release(version)[:2] != release(wanted):
        raise FloorError(f"{python} is Python {version}, not the declared {'newest' if newest else 'floor'} "
                         f"{wanted}; pass --python")
    project = f".[{','.join(extras())}]"
    if newest:  # a kept environment is brought to today's releases too
        _run([venv_python, "-m", "pip", "install", "--upgrade", "--upgrade-strategy", "eager", "-e", project], cwd=ROOT)
    else:
        floors = declared_floors()
        constraints = venv / "floor-constraints.txt"
        constraints.write_text("".join(f"{name}=={floor}\n" for name, floor in sorted(floors.items())))
        _run([venv_python, "-m", "pip", "install", "-c", str(constraints), "-e", project], cwd=ROOT)
    frozen = _run([venv_python, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True).stdout
    installed = read_versions(frozen)
    if not newest:
        wrong = {n: installed.get(n) for n, v in floors.items() if release(installed.get(n, "0")) != release(v)}
        if wrong:
            raise FloorError(f"not installed at their floors: {wrong}")
    return venv_python, {PYTHON: version, **installed}


def check(python: str, venv: Path, newest: bool = False) -> Record:
    """Build the environment in `venv` (`prepare`), run the suite there, and return its record."""
    venv_python, versions = prepare(python, venv, newest)
    record_path = NEWEST_RECORD if newest else RECORD
    command = [venv_python, *TEST_COMMAND, "--deselect", RECORD_TESTS[record_path]]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the venv's editable install of this checkout
    print("+", *command, flush=True)
    output = []
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as tests:
        for line in tests.stdout:
            print(line, end="", flush=True)
            output.append(line)
    if tests.returncode != 0:
        raise FloorError(f"the suite fails there ({_summary(''.join(output))}); {record_path.name} is unchanged")
    return Record(versions, _summary("".join(output)))


RECORD_HEADERS = {
    RECORD: ["# Written by `python .ci/check_floor.py`: the environment in which the test suite last passed with every",
             "# direct requirement of pyproject.toml at its lowest declared version (the others as pip resolved",
             "# them). tests/test_floor.py checks that these are pyproject.toml's floors."],
    NEWEST_RECORD: ["# Written by `python .ci/check_floor.py --newest`: the environment in which the test suite",
                    "# last passed, with the newest Python pyproject.toml's classifiers declare and every requirement",
                    "# as pip resolved it then. tests/test_floor.py checks that this Python is the newest one",
                    "# declared."],
}


def write_record(record: Record, path: Path = RECORD) -> None:
    lines = [*RECORD_HEADERS[path], f"{RESULT_PREFIX}{record.result}"]
    lines += [f"{name}=={version}" for name, version in sorted(record.versions.items())]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--newest", action="store_true",
                        help="check the newest end instead: the newest declared Python, today's releases; writes "
                             f"{NEWEST_RECORD.name} (default: the floor, {RECORD.name})")
    parser.add_argument("--python", metavar="PATH",
                        help="the interpreter to build the environment with (default: pythonX.Y on PATH, X.Y being "
                             "requires-python's floor, or with --newest the newest Python the classifiers declare)")
    parser.add_argument("--venv", metavar="DIR", type=Path,
                        help="build (or reuse) the environment there and keep it (default: a temporary folder, "
                             "removed afterwards)")
    args = parser.parse_args(argv)
    try:
        wanted = declared_python(args.newest)
    except FloorError as exc:
        parser.error(str(exc))
    python = args.python or shutil.which(f"python{wanted}")
    if python is None:
        parser.error(f"no python{wanted} on PATH; pass --python PATH to a Python {wanted}")
    record_path = NEWEST_RECORD if args.newest else RECORD
    try:
        if args.venv is not None:
            record = check(python, args.venv, args.newest)
        else:
            with tempfile.TemporaryDirectory(prefix="floor-venv-") as folder:
                record = check(python, Path(folder), args.newest)
    except (FloorError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    write_record(record, record_path)
    print(f"{'newest' if args.newest else 'floor'} check passed ({record.result}); wrote "
          f"{record_path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
