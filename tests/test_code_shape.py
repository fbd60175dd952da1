"""The shape of the code: a small flat top level, Pillow drawing in one module, no import circles, and imports that
do not go the wrong way (the evaluation never loads the presentation; `import tools.data` loads nothing)."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from tests.helpers import run_forked

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
MAX_TOP_LEVEL_MODULES = 15
FIGURES_MODULE = "tools/results/figures.py"
DRAWING_MODULES = {"PIL.ImageDraw", "PIL.ImageFont"}  # Pillow's drawing and fonts
EVALUATION = ["tools.in9.evaluate", "tools.challenge", "tools.training.loop", "tools.shards"]
PRESENTATION = "tools.results"


def modules(folder: Path = TOOLS) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_top_level_is_small():
    flat = sorted(p.name for p in TOOLS.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert "errors.py" in flat
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


@pytest.mark.slow
def test_pillow_drawing_and_fonts_live_in_one_module():
    drawing = {relative(p) for p in modules() if imported_modules(ast.parse(p.read_text(encoding="utf-8")))
               & DRAWING_MODULES}
    assert drawing == {FIGURES_MODULE}, f"Pillow's ImageDraw/ImageFont imported outside {FIGURES_MODULE}: {drawing}"


LOADING = [f"import {module}" for module in EVALUATION] + ["import tools.data"]


@pytest.fixture(scope="module")
def runs() -> dict:
    """Each statement of LOADING run as `python -c` runs it, then the tools.* modules loaded printed
    (tests.helpers.run_forked: one start-up for all, each in a fork that has loaded none of the toolkit)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    commands = [["-c", f"import json, sys\n{statement}\n"
                       "print(json.dumps(sorted(m for m in sys.modules if m.startswith('tools'))))"]
                for statement in LOADING]
    return dict(zip(LOADING, run_forked(commands, ROOT, env)))


def loaded_by(runs: dict, statement: str) -> list[str]:
    """The tools.* modules a fresh interpreter has loaded after `statement`."""
    done = runs[statement]
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", EVALUATION)
@pytest.mark.slow
def test_the_evaluation_does_not_load_the_presentation(module, runs):
    loaded = loaded_by(runs, f"import {module}")
    assert module in loaded
    presentation = [m for m in loaded if m == PRESENTATION or m.startswith(PRESENTATION + ".")]
    assert not presentation, f"import {module} loads {presentation}; the command layer composes them"


def test_importing_tools_data_loads_none_of_its_modules(runs):
    loaded = loaded_by(runs, "import tools.data")
    assert "tools.data" in loaded
    assert [m for m in loaded if m.startswith("tools.data.")] == []


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(path: Path, known: set[str]) -> set[str]:
    """The tools modules a module imports, at any depth (deferred imports in functions count: they only hide a
    circle until it runs), less those under `if TYPE_CHECKING:` and `if __name__ == "__main__":` (run as a
    script, the module is `__main__`, not itself); `from pkg import mod` is an import of pkg.mod."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(node) for block in ast.walk(tree)
                   if isinstance(block, ast.If) and any(word in ast.unparse(block.test)
                                                        for word in ("TYPE_CHECKING", "__main__"))
                   for node in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                         for a in node.names)
    return found & known


def import_graph() -> dict[str, set[str]]:
    """tools' modules and what each imports. The root package's lazy `from tools import benchmark` (a function-level
    import of tools.api inside tools/__init__.py's __getattr__) is left out: every module's `from tools import
    __version__` would otherwise close a circle through it."""
    paths = {_module_name(p): p for p in modules()}
    return {name: (set() if name == "tools" else _imports_of(path, set(paths))) for name, path in paths.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        circles.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return circles


def test_the_circle_finder_finds_a_circle_through_a_deferred_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]


@pytest.mark.slow
def test_no_import_circles():
    """No two modules import each other, directly or through others, even in a function: a circle makes the
    import order matter and each module's concern unclear (adapters and checkpoints, and the results package
    with the training package's evaluation, were such circles)."""
    assert import_circles(import_graph()) == []


def test_the_results_package_knows_nothing_of_training():
    """Training presents its runs through tools.results; the results package receives what it shows (the run's
    files come from tools.results.run_files, which the training package writes by)."""
    graph = import_graph()
    offenders = {name: sorted(m for m in imported if m.startswith("tools.training"))
                 for name, imported in graph.items() if name.startswith("tools.results")}
    assert not {name: found for name, found in offenders.items() if found}


@pytest.mark.slow
def test_every_thread_pool_carries_its_callers_context():
    """The toolkit's worker threads run with the context of the thread that gave them work (tools.threads.
    ContextThreadPool), so a message raised in one names options as its caller does (the Python API's words)."""
    made = []
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) \
                    in ("ThreadPoolExecutor", "Thread"):
                made.append(f"{relative(path)}:{node.lineno}")
    # the background imports (tools.threads) and the checkpoint writer raise no user error
    assert all(place.startswith(("tools/threads.py", "tools/training/checkpoint.py")) for place in made), made
