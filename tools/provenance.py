"""What a result came from (versions, device, model, data), and the outputs: checked before the work starts,
written atomically, a failed write reported in one line; the .npz/.npy/JSON files read back safely."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import platform
import secrets
import stat
import tempfile
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import numpy as np

from tools import __version__
from tools.data.temporary import atomic_names, remove_stale
from tools.errors import UserError, import_torchvision, option


def decoder(used: str | None = None) -> dict:
    """Who decoded the JPEGs, with Pillow's and its libjpeg's versions: another libjpeg gives other pixels."""
    import PIL  # noqa: PLC0415 (only here for the versions)
    from PIL import features  # noqa: PLC0415
    turbo = features.check_feature("libjpeg_turbo")
    return {"used": used, "pillow": PIL.__version__, "libjpeg": features.version("jpg"), "libjpeg_turbo":
            features.version_feature("libjpeg_turbo") if turbo else None}


def provenance(runtime_info: dict, model_info: dict, data_info: dict, decoder_used: str | None = None,
               decoded_cache: dict | None = None) -> dict:
    """Versions, device, model and data of a run; `decoded_cache`: `tools.data.store.DecodedCache.describe`."""
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
        "decoded_cache": decoded_cache,
    }


# ----------------------------------------------------------------------------------------------------------
# Before the work: can every output be written?

def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def _check_creatable(flag: str, path: Path, place: Path) -> None:
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
    """Refuse, before any work, an output that cannot be written or that shares another's path; creates nothing.
    Keys are the flags naming them (for the message); None: not asked for."""
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
    def __init__(self, path: Path, error: OSError):
        self.path, self.reason = Path(path), error.strerror or str(error)
        super().__init__(f"cannot write {self.path}: {self.reason}")


_swept: set[Path] = set()  # the outputs whose stale temporaries this process has removed (`atomic_write`)


@contextlib.contextmanager
def atomic_write(path: Path | str, mode: str = "w", newline: str | None = None) -> Iterator[IO]:
    """A temporary file beside `path`, synced and renamed over it on success (a SIGKILL's leftover is removed by the
    next write of the same file); mode 0666 less the umask; an OSError becomes a `WriteError` naming `path`."""
    path = Path(path)
    names = atomic_names(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.absolute() not in _swept:
            _swept.add(path.absolute())
            with contextlib.suppress(OSError):  # a clean-up that cannot be made keeps no output from being written
                remove_stale(path.parent, names, folders=False)
        while True:
            tmp = path.parent / names.make(secrets.token_hex(6))
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


def open_own(path: Path | str, append: bool = False) -> IO[bytes]:
    """`path` opened to write bytes in place (appended to, or emptied first), never through a link nor to anything
    but a regular file (OSError before a byte is written), so a link planted in an output folder cannot redirect
    the write."""
    flags = (os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0) | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    fd = os.open(path, flags, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        if not append:
            os.ftruncate(fd, 0)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "ab" if append else "wb")
    except BaseException:
        os.close(fd)
        raise


def write_json_atomic(path: Path | str, payload) -> None:
    with atomic_write(path) as fh:
        json.dump(payload, fh, indent=2)
        fh.write("\n")


def write_csv_atomic(path: Path | str, header: Sequence[str], rows) -> None:
    with atomic_write(path, newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)


def write_text_atomic(path: Path | str, text: str) -> None:
    with atomic_write(path) as fh:
        fh.write(text)


# A train.py run's files under its --output-dir that the reports read: the training loop's log of steps, and the
# evaluations `--eval-data` makes of the trained model and of its starting point (each with in9.json and
# challenge.json). Named here, beside the rest of what a run leaves, so that the training package writes by them
# and the results package reads by them without importing the other.
TRAINING_LOG = "train_log.jsonl"
TRAINED_EVAL_DIR, START_EVAL_DIR = "eval_trained", "eval_start"

def resume_hint() -> str:
    """How to go on after a failure that left a resumable state."""
    return f"fix the cause and run it again with {option('--resume')}: its saved state makes that quick"


def read_json(path: Path | str):
    """The JSON a regular file holds (a FIFO or device refused); otherwise OSError or ValueError."""
    from tools.data.hashing import open_regular  # noqa: PLC0415 (as read_npy)

    with open_regular(path) as fh:
        data = fh.read()
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:
        raise ValueError("JSON nested deeper than it can be read") from None


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of the .npz archive `path`; otherwise one of tools.errors.NUMPY_READ_ERRORS. The toolkit's
    archives are uncompressed, so a compressed member, or a header claiming more than its member holds, is refused
    (ValueError) before anything of the size it claims is made."""
    with open(path, "rb") as fh:
        archive = np.load(fh, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise ValueError("a single array, not an .npz archive")
        with archive:
            for member in archive.zip.infolist():
                if member.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(f"{member.filename} is compressed, which no archive of the toolkit is")
                with archive.zip.open(member) as data:
                    npy_header(data, member.file_size)
            return {name: archive[name] for name in archive.files}


def read_npy(source: Path | bytes, mmap: bool = False) -> np.ndarray:
    """The one .npy array of the file `source` (or of its bytes), refused as `npy_header` says (ValueError); other
    errors are tools.errors.NUMPY_READ_ERRORS. `mmap`: mapped read-only rather than read."""
    from tools.data.hashing import open_regular  # noqa: PLC0415 (a FIFO is refused, not waited on)

    with (io.BytesIO(source) if isinstance(source, bytes) else open_regular(source)) as fh:
        size = len(source) if isinstance(source, bytes) else os.fstat(fh.fileno()).st_size
        npy_header(fh, size)
        if mmap:
            return np.load(source, mmap_mode="r", allow_pickle=False)
        fh.seek(0)
        return np.load(fh, allow_pickle=False)


def npy_header(fh: IO[bytes], size: int) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, Fortran order, dtype) of the .npy header at `fh`'s start, `fh` left at the array's first byte; an
    .npz archive, Python objects and an array larger than the file's `size` bytes are refused."""
    if fh.read(2) == b"PK":
        raise ValueError("an .npz archive (a zip of arrays), not one .npy array")
    fh.seek(0)
    version = np.lib.format.read_magic(fh)
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    if version not in readers:
        raise ValueError(f".npy format {version}, which the toolkit does not read")
    shape, fortran, dtype = readers[version](fh)
    if dtype.hasobject:
        raise ValueError("an array of Python objects")
    if math.prod(shape) * dtype.itemsize > size - fh.tell():
        raise ValueError(f"its header claims an array of shape {shape} ({dtype}), more than its {size} bytes")
    return shape, fortran, dtype


_KINDS = {"b": "booleans", "iu": "integers", "biu": "integers", "f": "floats", "fiu": "numbers"}


def checked_array(arrays: Mapping[str, np.ndarray], name: str, shape: tuple, kind: str, low=None, high=None,
                  dtype=None) -> np.ndarray:
    """`arrays[name]` as `dtype`, checked: `shape` (None: any length), `kind` (numpy kind letters), values within
    [`low`, `high`], no NaN; otherwise a ValueError saying what is wrong (missing: KeyError)."""
    value = np.asarray(arrays[name])
    if value.dtype.kind not in kind:
        raise ValueError(f"{name} holds {value.dtype}, not {_KINDS.get(kind, kind)}")
    if value.ndim != len(shape) or any(want is not None and want != got for want, got in zip(shape, value.shape)):
        wanted = " x ".join("any" if n is None else str(n) for n in shape) or "a scalar"
        raise ValueError(f"{name} is of shape {' x '.join(map(str, value.shape)) or 'a scalar'}, not {wanted}")
    if value.size and value.dtype.kind == "f" and np.isnan(value).any():
        raise ValueError(f"{name} holds NaN")
    if value.size and low is not None and value.min() < low:
        raise ValueError(f"{name} holds {value.min()}, below {low}")
    if value.size and high is not None and value.max() > high:
        raise ValueError(f"{name} holds {value.max()}, above {high}")
    return value if dtype is None else value.astype(dtype, copy=False)


class OutputFiles:
    """A command's output files: one that cannot be written does not stop the others; leaving the block raises one
    user error naming what failed and what was written, printed after the command's `lines`.

        with OutputFiles(resume_hint()) as outputs:
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

    def __enter__(self) -> OutputFiles:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is not None or not self.failed:
            return
        failed = "; ".join(f"{e.path} ({e.reason})" for e in self.failed)
        written = f"wrote {', '.join(map(str, self.written))}" if self.written else "wrote nothing else"
        error = UserError(f"could not write {failed}; {written}; {self.hint}")
        error.stdout = list(self.lines or [])
        raise error
