"""Optional extras (tools.errors.optional_module): a missing module reads "not installed", a module that is
installed but fails to import says so with its own first line, and an import started in the background
(tools.threads.import_in_background, as the scripts preload torchvision) never races the same libraries
imported where the model is built.

An error line that names keys, globals, folders or columns a file or folder holds names a few and counts the rest
(`tools.errors.key_list`): a file with thousands of them still gives one short line."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest
import torch

from tools.data.build_inputs import class_folder_labels
from tools.errors import UserError, optional_module
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.models.sources import load_model
from tools.results.matrix import BACKGROUND_COLUMNS, _read_index_csv
from tools.threads import import_in_background, wait_for_background_imports


def _write_package(root, name: str, source: str) -> None:
    (root / f"{name}.py").write_text(textwrap.dedent(source))


@pytest.fixture
def fake_modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    wait_for_background_imports()
    for name in [n for n in sys.modules if n.startswith("fake_")]:
        del sys.modules[name]


def test_a_missing_module_is_not_installed(fake_modules):
    with pytest.raises(UserError, match=r"^a clip: model needs open_clip_torch, which is not installed; "
                                        r"run `pip install open_clip_torch`"):
        optional_module("fake_missing", "a clip: model", "open_clip_torch", "clip")


def test_a_module_whose_dependency_is_missing_is_installed_but_broken(fake_modules):
    _write_package(fake_modules, "fake_broken_dep", "import fake_not_there\n")
    with pytest.raises(UserError, match=r"^open_clip_torch is installed but failed to import \(fake_broken_dep\): "
                                        r"No module named 'fake_not_there'"):
        optional_module("fake_broken_dep", "a clip: model", "open_clip_torch", "clip")


def test_a_module_that_raises_on_import_is_installed_but_broken(fake_modules):
    _write_package(fake_modules, "fake_raises", "raise RuntimeError('CUDA driver too old\\nmore detail')\n")
    with pytest.raises(UserError, match=r"^open_clip_torch is installed but failed to import \(fake_raises\): "
                                        r"CUDA driver too old;") as caught:
        optional_module("fake_raises", "a clip: model", "open_clip_torch", "clip")
    assert "not installed" not in str(caught.value)


def test_a_background_import_never_races_the_model_libraries(fake_modules):
    """Two threads importing modules that import each other (torchvision in the background, open_clip's import of
    torchvision.ops in the main thread) each hold one module's import lock and want the other's; Python breaks
    that deadlock by handing one of them a half-initialised module, a false ImportError. So optional_module waits
    for the background imports: the main thread's import starts only after the background one has finished."""
    _write_package(fake_modules, "fake_events", "EVENTS = []\n")
    _write_package(fake_modules, "fake_vision", """
        import time
        import fake_events
        fake_events.EVENTS.append("vision started")
        time.sleep(0.3)
        fake_events.EVENTS.append("vision finished")
    """)
    _write_package(fake_modules, "fake_clip", """
        import fake_events
        fake_events.EVENTS.append("clip started")
        import fake_vision
    """)
    import fake_events  # noqa: PLC0415
    import_in_background(["fake_vision"])
    time.sleep(0.1)  # the background thread is inside fake_vision's import
    optional_module("fake_clip", "a clip: model", "open_clip_torch", "clip")
    assert fake_events.EVENTS == ["vision started", "vision finished", "clip started"]


def test_two_threads_may_wait_for_the_background_imports_at_once(monkeypatch):
    """The data thread (the decoder's probe) and the main thread (model building) wait for the same background
    imports at once (`tools.threads.alongside`): both return, and neither fails on the other's clean-up (each is
    made to pause between finding the finished import thread and forgetting it)."""
    import threading  # noqa: PLC0415

    from tools import threads  # noqa: PLC0415

    class Pausing(list):
        def __contains__(self, item):
            found = super().__contains__(item)
            time.sleep(0.1)  # the other waiting thread runs here
            return found

    monkeypatch.setattr(threads, "_background", Pausing())
    import_in_background(["json"])
    errors = []

    def wait():
        try:
            wait_for_background_imports()
        except Exception as exc:  # noqa: BLE001 (recorded for the assertion)
            errors.append(exc)

    waiters = [threading.Thread(target=wait) for _ in range(2)]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join()
    assert not errors, errors
    assert not threads._background


LONGEST = 600
MANY = 400


class Blocked:
    """A class the weights-only unpickler refuses; MANY subclasses of it below, each a global of its own."""


BLOCKED = [type(f"Blocked{i}", (Blocked,), {"__module__": __name__}) for i in range(MANY)]
globals().update({cls.__name__: cls for cls in BLOCKED})


def refusal(call) -> str:
    with pytest.raises(UserError) as error:
        call()
    line = str(error.value)
    assert "\n" not in line and len(line) < LONGEST, f"{len(line)} characters: {line[:300]}"
    return line


def test_a_pickle_of_many_blocked_globals(tmp_path):
    path = tmp_path / "many.pt"
    torch.save({f"x{i}": cls() for i, cls in enumerate(BLOCKED)}, path)
    assert f"and {MANY - 8} more" in refusal(lambda: load_model(checkpoint=path))


def test_a_robustness_checkpoint_with_many_stray_keys(tmp_path):
    state = {f"model.{k}": v for k, v in SmallCNN(9).state_dict().items()}
    state.update({"normalizer.new_mean": torch.zeros(3), "normalizer.new_std": torch.ones(3)})
    state.update({f"stray.{i}": torch.zeros(1) for i in range(MANY)})
    path = tmp_path / "robust.pt"
    torch.save(state, path)
    assert "more" in refusal(lambda: load_model(SMALL_CNN, checkpoint=path))


def test_an_images_folder_of_many_unknown_folders(tmp_path):
    folders = [f"n{i:08d}" for i in range(MANY)]  # an ImageNet-style folder, short of its 1000 classes
    assert "more" in refusal(lambda: class_folder_labels(tmp_path, folders))


def test_a_matrix_file_with_many_columns(tmp_path):
    path = tmp_path / "matrix.csv"
    path.write_text(",".join(f"column{i}" for i in range(MANY)) + "\n")
    assert "more" in refusal(lambda: _read_index_csv(path, BACKGROUND_COLUMNS))
