"""The shape of the code: no module too long to read, a small flat top level, Pillow drawing in one module, and
imports that do not go the wrong way (the evaluation never loads the presentation; `import tools.data` loads
nothing)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
MAX_MODULE_LINES = 450
MAX_TOP_LEVEL_MODULES = 15
FIGURES_MODULE = "tools/results/figures.py"
DRAWING_MODULES = {"PIL.ImageDraw", "PIL.ImageFont"}  # Pillow's drawing and fonts
EVALUATION = ["tools.evaluate", "tools.challenge", "tools.training.loop", "tools.shards"]
PRESENTATION = "tools.results"


def modules(folder: Path = TOOLS) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_module_is_longer_than_the_limit():
    lengths = {relative(p): len(p.read_text(encoding="utf-8").splitlines()) for p in modules()}
    assert len(lengths) > 40, "the walk found too few modules to be tools/"
    too_long = {path: n for path, n in lengths.items() if n > MAX_MODULE_LINES}
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by concern): {too_long}"


def test_the_top_level_is_small():
    flat = sorted(p.name for p in TOOLS.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert "evaluate.py" in flat
    assert len(flat) <= MAX_TOP_LEVEL_MODULES, (f"tools/ holds {len(flat)} modules (at most "
                                                f"{MAX_TOP_LEVEL_MODULES}; move some into a package): {flat}")


def imported_modules(tree: ast.AST) -> set[str]:
    """Every module an import statement names, with `from PIL import ImageDraw` as PIL.ImageDraw."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_pillow_drawing_and_fonts_live_in_one_module():
    drawing = {relative(p) for p in modules() if imported_modules(ast.parse(p.read_text(encoding="utf-8")))
               & DRAWING_MODULES}
    assert drawing == {FIGURES_MODULE}, f"Pillow's ImageDraw/ImageFont imported outside {FIGURES_MODULE}: {drawing}"


def loaded_by(statement: str) -> list[str]:
    """The tools.* modules a fresh interpreter has loaded after `statement`."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(m for m in sys.modules if m.startswith('tools'))))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", EVALUATION)
def test_the_evaluation_does_not_load_the_presentation(module):
    loaded = loaded_by(f"import {module}")
    assert module in loaded
    presentation = [m for m in loaded if m == PRESENTATION or m.startswith(PRESENTATION + ".")]
    assert not presentation, f"import {module} loads {presentation}; the command layer composes them"


def test_importing_tools_data_loads_none_of_its_modules():
    loaded = loaded_by("import tools.data")
    assert "tools.data" in loaded
    assert [m for m in loaded if m.startswith("tools.data.")] == []
