"""What a result came from (versions, device, model, the data read), and writing results atomically."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
from pathlib import Path
from typing import IO, Iterator

from tools import __version__


def provenance(runtime_info: dict, model_info: dict, data_info: dict) -> dict:
    import torch  # noqa: PLC0415 (only here for the versions: writing results needs neither)
    import torchvision  # noqa: PLC0415
    return {
        "toolkit_version": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        **runtime_info,
        **model_info,
        "data": data_info,
    }


@contextlib.contextmanager
def atomic_write(path: Path | str, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on success it is synced and renamed over `path`, so a
    crash never leaves half a file. The file is created with mode 0666 less the user's umask, as `open` does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path | str, payload) -> None:
    """Write JSON to `path` atomically (see `atomic_write`)."""
    with atomic_write(path) as fh:
        json.dump(payload, fh, indent=2)
        fh.write("\n")
