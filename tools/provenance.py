"""What a result came from: versions, device, model, and the data read."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from pathlib import Path

import torch

from tools import __version__


def provenance(runtime_info: dict, model_info: dict, data_info: dict) -> dict:
    import torchvision  # noqa: PLC0415 (only here for its version)
    return {
        "toolkit_version": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        **runtime_info,
        **model_info,
        "data": data_info,
    }


def write_json_atomic(path: Path | str, payload) -> None:
    """Write JSON to `path` through a temporary file and a rename, so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=2)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
