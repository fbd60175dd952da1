"""What a result came from (versions, device, model, the data read), and writing outputs: every output path
checked before the work starts, every file written atomically, a write that fails reported in one line, and the
.npz archives written so (resume states, shards) read back."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterator, Mapping

import numpy as np

from tools import __version__
from tools.errors import UserError, import_torchvision


def decoder(used: str | None = None) -> dict:
    """The image decoder: `used` (who decoded the JPEGs, tools.data.decoders.Decoder: the pixels are Pillow's either
    way), Pillow's version and its libjpeg's, and whether that is libjpeg-turbo (with its version):
    another libjpeg gives other pixels for the same JPEG file, and so may change a prediction."""
    import PIL  # noqa: PLC0415 (only here for the versions)
    from PIL import features  # noqa: PLC0415
    turbo = features.check_feature("libjpeg_turbo")
    return {"used": used, "pillow": PIL.__version__, "libjpeg": features.version("jpg"), "libjpeg_turbo":
            features.version_feature("libjpeg_turbo") if turbo else None}


def provenance(runtime_info: dict, model_info: dict, data_info: dict, decoder_used: str | None = None) -> dict:
    """Versions, device, model and data of a run; `decoder_used`: who decoded the JPEGs (`decoder`)."""
    import torch  # noqa: PLC0415 (only here for the versions: writing results needs neither)
    torchvision = import_torchvision()
    return {
        "toolkit_version": __version__,
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": platform.python_version(),
        "decoder": decoder(decoder_used),
        **runtime_info,
        **model_info,
        "data": data_info,
    }


# ----------------------------------------------------------------------------------------------------------
# Before the work: can every output be written?

def _nearest_existing(path: Path) -> Path:
    """`path` itself, or its closest ancestor that exists (the folder a new path would be created under)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def _check_creatable(flag: str, path: Path, place: Path) -> None:
    """`path` can be made under `place`, its nearest existing ancestor: a folder this process may write in."""
    if not place.is_dir():
        raise UserError(f"{flag} {path} cannot be created: {place} is a file, not a folder; choose another path")
    try:
        with tempfile.TemporaryFile(dir=place):
            pass
    except OSError as exc:
        raise UserError(f"{flag} {path} cannot be written: no file can be created in {place} "
                        f"({exc.strerror or exc}); choose another path") from None


def check_outputs(files: Mapping[str, Path | str | None] | None = None,
                  folders: Mapping[str, Path | str | None] | None = None) -> None:
    """Check, before any data is read or any model is built, that every output can be written: each of `files`
    names no folder, each of `folders` no file, each can be created where it is (or already exists) by this
    process, and no two outputs share a path. Keys are the flags that name them, for the message; None values
    are outputs not asked for. Creates nothing."""
    named = [(flag, Path(path), False) for flag, path in (files or {}).items() if path is not None]
    named += [(flag, Path(path), True) for flag, path in (folders or {}).items() if path is not None]
    seen: dict[Path, str] = {}
    for flag, path, is_folder in named:
        try:
            if is_folder and path.exists() and not path.is_dir():
                raise UserError(f"{flag} {path} is a file; give the path of a folder (it is created if missing)")
            if not is_folder and path.is_dir():
                raise UserError(f"{flag} {path} is a folder; give the path of a file to write")
            _check_creatable(flag, path, _nearest_existing(path if is_folder else path.parent))
            resolved = path.resolve()
        except OSError as exc:  # a place this user may not even look into (stat refused: EACCES)
            raise UserError(f"{flag} {path} cannot be checked ({exc.strerror or exc}); choose another path") from None
        if resolved in seen:
            raise UserError(f"{seen[resolved]} and {flag} both name {path}; give each output its own path")
        seen[resolved] = flag


# ----------------------------------------------------------------------------------------------------------
# Writing

class WriteError(UserError):
    """An output file that could not be written (a full disk, a folder removed or made read-only meanwhile)."""

    def __init__(self, path: Path, error: OSError):
        self.path, self.reason = Path(path), error.strerror or str(error)
        super().__init__(f"cannot write {self.path}: {self.reason}")


@contextlib.contextmanager
def atomic_write(path: Path | str, mode: str = "w", newline: str | None = None) -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on success it is synced and renamed over `path`, so a
    crash, a full disk or an interruption never leaves half a file (nor the temporary one, short of SIGKILL).
    The file is created with mode 0666 less the user's umask, as `open` does. An OSError while writing becomes
    a `WriteError` naming `path`. Text is UTF-8; `newline` is `open`'s (an empty string for the csv module)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
                break
            except FileExistsError:
                continue
    except OSError as exc:
        raise WriteError(path, exc) from None
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8", newline=newline) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WriteError(path, exc) from None
        raise


def write_json_atomic(path: Path | str, payload) -> None:
    """Write JSON to `path` atomically (see `atomic_write`)."""
    with atomic_write(path) as fh:
        json.dump(payload, fh, indent=2)
        fh.write("\n")


def write_text_atomic(path: Path | str, text: str) -> None:
    """Write UTF-8 text to `path` atomically (see `atomic_write`)."""
    with atomic_write(path) as fh:
        fh.write(text)


# A train.py run's files under its --output-dir that the reports read: the training loop's log of steps, and the
# evaluations `--eval-data` makes of the trained model and of its starting point (each with in9.json and
# challenge.json). Named here, beside the rest of what a run leaves, so that the training package writes by them
# and the results package reads by them without importing the other.
TRAINING_LOG = "train_log.jsonl"
TRAINED_EVAL_DIR, START_EVAL_DIR = "eval_trained", "eval_start"

RESUME_HINT = "fix the cause and rerun the same command with --resume: its saved state makes that quick"


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of the .npz archive `path`, read through our own file handle (closed also when numpy refuses
    the file); what is not such an archive raises one of tools.errors.NUMPY_READ_ERRORS (a .npy array: ValueError)."""
    with open(path, "rb") as fh:
        archive = np.load(fh, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise ValueError("a single array, not an .npz archive")
        with archive:
            return {name: archive[name] for name in archive.files}


class OutputFiles:
    """A command's output files, written one after another: one that cannot be written does not stop the
    others, and leaving the `with` block raises one user error that names what failed and what was written,
    carrying the command's `lines` (its `stdout`), which are printed before it.

        with OutputFiles(RESUME_HINT) as outputs:
            outputs.write(write_json_atomic, results_file, payload)
    """

    def __init__(self, hint: str, lines: list[str] | None = None):
        self.hint = hint
        self.lines = lines  # what the command prints: printed before the error all the same (UserError.stdout)
        self.written: list[Path] = []
        self.failed: list[WriteError] = []

    def write(self, writer: Callable, path: Path | str, *args, **kwargs):
        """`writer(path, *args, **kwargs)`'s result; None when it could not write."""
        try:
            result = writer(path, *args, **kwargs)
        except WriteError as exc:
            self.failed.append(exc)
            return None
        self.written.append(Path(path))
        return result

    def wrote(self, path: Path | str) -> bool:
        """Whether the writer given `path` succeeded."""
        return Path(path) in self.written

    def __enter__(self) -> "OutputFiles":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None or not self.failed:
            return
        failed = "; ".join(f"{e.path} ({e.reason})" for e in self.failed)
        written = f"wrote {', '.join(map(str, self.written))}" if self.written else "wrote nothing else"
        error = UserError(f"could not write {failed}; {written}; {self.hint}")
        error.stdout = list(self.lines or [])
        raise error
