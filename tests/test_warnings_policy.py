"""The suite's warning policy (pyproject.toml's filterwarnings): a warning attributed to a `tools` module fails
the test, one from elsewhere does not, and the tests may still save TorchScript (users have such files)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, which pytest itself needs there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def read_pyproject_filters() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as fh:
        return tomllib.load(fh)["tool"]["pytest"]["ini_options"]["filterwarnings"]


def raise_from(module_name: str, category: type[Warning] = DeprecationWarning) -> None:
    """warnings.warn run as code of the module `module_name` (its globals' __name__, which warnings reads)."""
    code = compile("import warnings\nwarnings.warn('old API', CATEGORY)\n", f"<{module_name}>", "exec")
    exec(code, {"__name__": module_name, "CATEGORY": category})  # noqa: S102


def test_the_configuration_names_tools():
    assert any(f.startswith("error::Warning:tools") for f in read_pyproject_filters())


@pytest.mark.parametrize("module_name", ["tools", "tools.demo", "tools.models.checkpoints"])
def test_a_warning_from_a_tools_module_is_an_error(module_name):
    with pytest.raises(DeprecationWarning, match="old API"):
        raise_from(module_name)


@pytest.mark.parametrize("module_name", ["toolsmith", "numpy.core", "tests.helpers"])
def test_a_warning_from_elsewhere_is_not(module_name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # as the suite: record, not raise
        for action, message, category, module, lineno in _suite_filters():
            warnings.filterwarnings(action, message, category, module, lineno)
        raise_from(module_name)
    assert [str(w.message) for w in caught] == ["old API"]


def _suite_filters():
    from _pytest.config import parse_warning_filter  # noqa: PLC0415
    return [parse_warning_filter(f, escape=False) for f in reversed(read_pyproject_filters())]


def test_the_tests_may_still_save_torchscript(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(torch.nn.Linear(2, 2), torch.zeros(1, 2))
    torch.jit.save(traced, tmp_path / "m.ts")  # torch's FutureWarning here is ignored, not an error
    assert (tmp_path / "m.ts").stat().st_size > 0
