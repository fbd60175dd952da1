"""An error line that names keys, globals, folders or columns a file or folder holds names a few and counts the rest
(`tools.errors.key_list`): a file with thousands of them still gives one short line."""

from __future__ import annotations

import pytest
import torch

from tools.data.build_inputs import class_folder_labels
from tools.errors import UserError
from tools.models.architectures import SMALL_CNN, SmallCNN
from tools.models.sources import load_model
from tools.results.matrix import BACKGROUND_COLUMNS, _read_index_csv

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
