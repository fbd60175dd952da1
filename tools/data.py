"""Getting, checking and building IN-9 test data: `python -m tools.data {fetch,verify,build}`.

fetch   downloads the release archive (resuming a partial download), checks its SHA-256 and extracts it
        safely into --data-path, so that <data-path>/original/val/... exist.
verify  checks the folder layout both scripts read and prints a variation x class table of counts and
        every problem found; `quick_check` is the fast form the scripts run before they start.
build   makes the eight variations and fg_mask from labelled images with one bounding box each,
        following the paper's Appendix A (resize 256, centre crop 224, four filters, GrabCut masks).
"""

from __future__ import annotations

import argparse
import enum
import gzip
import http.client
import logging
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Iterable, Mapping, Sequence

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from tools import __version__, boxes as boxes_mod, grabcut, variations
from tools.datasets import IMAGE_EXTENSIONS, MASK_EXTENSION, check_data_root
from tools.cli import add_log_level_argument, run_main
from tools.threads import default_workers, map_in_threads
from tools.errors import UserError
from tools.hashing import sha256_file
from tools.in9 import IMAGE_SIZE, MASK_FOLDER, NUM_IN9_CLASSES, SPLIT, VARIATIONS, Variation
from tools.provenance import write_json_atomic

log = logging.getLogger(__name__)

LAYOUT_NAMES: tuple[str, ...] = (*VARIATIONS, MASK_FOLDER)
MIXED = (Variation.MIXED_SAME.value, Variation.MIXED_RAND.value, Variation.MIXED_NEXT.value)

# ---------------------------------------------------------------------------------------------- fetch

RELEASE_URL = ("https://github.com/MadryLab/backgrounds_challenge/releases/download/data/"
               "backgrounds_challenge_data.tar.gz")
RELEASE_SIZE = 279_581_133
RELEASE_SHA256 = "2d66f571b0492986b347e37d2ee498ed34b58012af425d772dacda4422896fe7"
ARCHIVE_NAME = "backgrounds_challenge_data.tar.gz"
PART_SUFFIX = ".part"
BAD_SUFFIX = ".bad"
CHUNK_SIZE = 1 << 20
DEFAULT_TIMEOUT_S = 60.0


@dataclass
class FetchResult:
    root: Path
    source: str
    sha256: str | None
    verified: bool
    downloaded_bytes: int = 0
    resumed: bool = False
    files: int = 0
    archive_kept: Path | None = None
    already_present: bool = False
    counts: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        if self.already_present:
            return [f"{self.root} already holds every variation and {MASK_FOLDER}/; nothing fetched "
                    f"(`python -m tools.data verify --data-path {self.root}` checks it)"]
        fetched = ""
        if self.downloaded_bytes:
            fetched = f" ({self.downloaded_bytes:,} bytes downloaded{', resumed' if self.resumed else ''})"
        check = "verified" if self.verified else "NOT verified (no expected SHA-256)"
        lines = [f"source: {self.source}{fetched}", f"sha256: {self.sha256} {check}",
                 f"extracted {self.files} files into {self.root}",
                 "files per folder: " + ", ".join(f"{name} {n}" for name, n in self.counts.items())]
        if self.archive_kept is not None:
            lines.append(f"archive kept at {self.archive_kept}")
        return lines


def archive_name(url: str) -> str:
    """The file name the URL's path ends in when it names an archive, else the release's name."""
    name = PurePosixPath(urllib.parse.urlparse(url).path).name
    return name if name.endswith((".tar.gz", ".tgz", ".tar")) else ARCHIVE_NAME


def fetch(data_path: Path, url: str = RELEASE_URL, sha256: str | None = None, keep_archive: bool = False,
          archive: Path | None = None, progress: bool = True, timeout: float = DEFAULT_TIMEOUT_S) -> FetchResult:
    """Download (or take `archive`), check the SHA-256 and extract the release into `data_path`.

    The expected SHA-256 is `sha256`, else the release's own when `url` is the release URL; with
    another URL and no `sha256` the check is skipped with a warning and the file's hash is reported.
    The download goes to <data_path>/<name>.part and resumes from it; a downloaded file whose hash is
    wrong is moved aside to <name>.bad. A file given as `archive` is never moved or deleted.
    """
    root = Path(data_path)
    present = [name for name in LAYOUT_NAMES if (root / name).exists()]
    if len(present) == len(LAYOUT_NAMES):
        return FetchResult(root, url, None, False, already_present=True)
    if present:
        raise UserError(f"{root} already holds part of a dataset ({', '.join(present)}); remove those folders or "
                        f"pass an empty --data-path, then rerun fetch")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --data-path {root}: {exc.strerror}; pass a folder you can write to") from None
    expected = sha256.lower() if sha256 else (RELEASE_SHA256 if url == RELEASE_URL else None)

    if archive is not None:
        archive = Path(archive)
        if not archive.is_file():
            raise UserError(f"--archive {archive} is not a file; pass the downloaded {ARCHIVE_NAME}")
        digest = _check_sha256(archive, expected, str(archive), move_aside=False)
        files = extract_archive(archive, root, progress)
        result = FetchResult(root, str(archive), digest, expected is not None, files=files, archive_kept=archive)
    else:
        dest = root / archive_name(url)
        downloaded, resumed, source = 0, False, url
        if dest.is_file():
            log.info("found %s: checking it instead of downloading", dest)
            source = str(dest)
        else:
            part = dest.with_name(dest.name + PART_SUFFIX)
            size = RELEASE_SIZE if url == RELEASE_URL else None
            downloaded, resumed = download(url, part, dest, progress, timeout, size)
            os.replace(part, dest)
        digest = _check_sha256(dest, expected, source, move_aside=True)
        files = extract_archive(dest, root, progress)
        if not keep_archive:
            dest.unlink()
        result = FetchResult(root, url, digest, expected is not None, downloaded, resumed, files,
                             dest if keep_archive else None)
    try:
        result.counts = quick_check(root, VARIATIONS, need_masks=True)
    except UserError as exc:
        raise UserError(f"the archive was extracted into {root}, but the result is not a usable release: {exc}") \
            from None
    return result


def _check_sha256(path: Path, expected: str | None, source: str, move_aside: bool) -> str:
    digest = sha256_file(path)
    if expected is None:
        log.warning("not checking the SHA-256 of %s (from %s, not the release URL, and no --sha256 given); it is %s",
                    path.name, source, digest)
        return digest
    if digest == expected:
        return digest
    if move_aside:
        bad = path.with_name(path.name + BAD_SUFFIX)
        os.replace(path, bad)
        raise UserError(f"SHA-256 mismatch for {source}: got {digest}, expected {expected}; the file was moved aside "
                        f"to {bad} (delete it): rerun fetch to download it again, or pass --sha256 if the release "
                        f"has really changed")
    raise UserError(f"SHA-256 mismatch for {path}: got {digest}, expected {expected}; the file was left in place: "
                    f"pass the release archive, or --sha256 {digest} if you trust this file")


def _offline_message(url: str, part: Path, dest: Path, reason: str) -> str:
    return (f"cannot download {url} ({reason}); download it by other means to {dest} (e.g. curl -L -o {dest} {url}) "
            f"and rerun this command, which then verifies and extracts it (or pass --archive FILE); a partial "
            f"{part.name} there is resumed")


def _content_range(value: str | None) -> tuple[int | None, int | None]:
    """(first byte, total size) from a Content-Range header such as 'bytes 100-999/1000'."""
    match = re.fullmatch(r"\s*bytes\s+(\d+)-\d+/(\d+|\*)\s*", value or "")
    if not match:
        return None, None
    return int(match.group(1)), (None if match.group(2) == "*" else int(match.group(2)))


def download(url: str, part: Path, dest: Path, progress: bool = True, timeout: float = DEFAULT_TIMEOUT_S,
             expected_size: int | None = None) -> tuple[int, bool]:
    """Download `url` into `part`, resuming from what `part` already holds; returns (bytes fetched, resumed).

    A server that answers a Range request with the whole file (200) is downloaded again from the start.
    Connection failures end in a UserError that says where to put a manual download (`dest`); a
    transfer that stops midway keeps `part` for the next run to resume.
    """
    offset = part.stat().st_size if part.is_file() else 0
    headers = {"User-Agent": f"bg-challenge-toolkit/{__version__}"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # nothing after `offset`: the partial file is already whole
            log.info("%s is already complete (%d bytes)", part, offset)
            return 0, True
        raise UserError(_offline_message(url, part, dest, f"HTTP {exc.code} {exc.reason}")) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise UserError(_offline_message(url, part, dest, str(reason))) from None

    with response:
        length = response.headers.get("Content-Length")
        total = int(length) if length and length.isdigit() else None
        resumed = False
        if offset and response.status == 206:
            start, size = _content_range(response.headers.get("Content-Range"))
            if start != offset:
                log.warning("the server resumed %s at byte %s instead of %d; downloading it again", url, start, offset)
                response.close()
                part.unlink()
                return download(url, part, dest, progress, timeout, expected_size)
            resumed, total = True, size
            log.info("resuming %s at byte %d", url, offset)
        elif offset:
            log.warning("the server ignored the request to resume %s (no Range support); downloading it again from "
                        "the start", url)
            offset = 0
        if expected_size is not None and total not in (None, expected_size):
            log.warning("the server says %s is %d bytes, the release is %d; the SHA-256 check will tell", url, total,
                        expected_size)
        total = total or expected_size
        if total is not None:
            _check_free_space(part.parent, total - offset + total)
        received = offset
        with open(part, "ab" if offset else "wb") as fh, \
                tqdm(total=total, initial=offset, unit="B", unit_scale=True, unit_divisor=1024, desc=dest.name,
                     disable=not progress, leave=False) as bar:
            try:
                for chunk in iter(lambda: response.read(CHUNK_SIZE), b""):
                    fh.write(chunk)
                    received += len(chunk)
                    bar.update(len(chunk))
            except (OSError, http.client.HTTPException) as exc:
                raise UserError(_interrupted_message(url, part, received, total, str(exc) or type(exc).__name__)) \
                    from None
    if total is not None and received < total:
        raise UserError(_interrupted_message(url, part, received, total, "the connection closed early"))
    return received - offset, resumed


def _interrupted_message(url: str, part: Path, received: int, total: int | None, reason: str) -> str:
    of_total = f" of {total:,}" if total is not None else ""
    return (f"download of {url} stopped after {received:,}{of_total} bytes ({reason}); the partial file {part} is "
            f"kept: rerun the same command to resume")


def _check_free_space(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise UserError(f"{folder} has {free / 2**20:,.0f} MiB free, but the download and its extraction need about "
                        f"{needed / 2**20:,.0f} MiB; free some space or pass another --data-path")


def _unsafe_reason(member: tarfile.TarInfo) -> str | None:
    if member.issym() or member.islnk():
        return f"a {'symbolic' if member.issym() else 'hard'} link to {member.linkname!r}"
    if not (member.isfile() or member.isdir()):
        return "a device, pipe or other special file"
    name = member.name.replace("\\", "/")
    if name.startswith("/") or re.match(r"[A-Za-z]:", name):
        return "an absolute path"
    if ".." in name.split("/"):
        return "a path that climbs out with '..'"
    if "\x00" in name:
        return "a NUL byte in its name"
    return None


def plan_extraction(members: Sequence[tarfile.TarInfo], archive: Path) -> list[tuple[tarfile.TarInfo, tuple[str, ...]]]:
    """Each member with its path inside the target, the archive's single top folder stripped.

    Refuses the whole archive, before anything is written, when any member is a link, a special file,
    an absolute path or a path with '..'.
    """
    unsafe = [(m.name, why) for m in members if (why := _unsafe_reason(m)) is not None]
    if unsafe:
        name, why = unsafe[0]
        raise UserError(f"refusing to extract {archive}: {len(unsafe)} unsafe member(s), e.g. {name!r} is {why}; "
                        f"nothing was extracted (use the release archive)")
    plan = []
    for m in members:
        parts = tuple(p for p in m.name.replace("\\", "/").split("/") if p not in ("", "."))
        if parts:
            plan.append((m, parts))
    tops = {parts[0] for _, parts in plan}
    if len(tops) == 1 and next(iter(tops)) not in LAYOUT_NAMES and any(len(parts) > 1 for _, parts in plan):
        plan = [(m, parts[1:]) for m, parts in plan if len(parts) > 1]
    return plan


def extract_archive(archive: Path, root: Path, progress: bool = True) -> int:
    """Extract a tar archive into `root`, its top folder (bg_challenge/) stripped; returns the file count.

    Members are checked first (see `plan_extraction`), written under a temporary folder inside `root`
    as plain files and folders (no links, owners or modes from the archive), then moved into place.
    """
    root = Path(root)
    try:
        with tarfile.open(archive, "r:*") as tar:
            plan = plan_extraction(tar.getmembers(), archive)
            if not plan:
                raise UserError(f"archive {archive} is empty; pass the release archive")
            tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root))
            try:
                base = os.path.realpath(tmp) + os.sep
                files = 0
                for member, parts in tqdm(plan, desc="extract", unit="file", disable=not progress, leave=False):
                    target = tmp.joinpath(*parts)
                    if not os.path.realpath(target).startswith(base):
                        raise UserError(f"refusing to extract {archive}: member {member.name!r} would land outside "
                                        f"{root}")
                    if member.isdir():
                        target.mkdir(parents=True, exist_ok=True)
                        continue
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with tar.extractfile(member) as src, open(target, "wb") as dst:  # type: ignore[union-attr]
                        shutil.copyfileobj(src, dst, CHUNK_SIZE)
                    files += 1
                for entry in sorted(tmp.iterdir()):
                    if (root / entry.name).exists():
                        log.warning("kept the existing %s; the archive's copy was not extracted", root / entry.name)
                        continue
                    os.replace(entry, root / entry.name)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        reason = " ".join(str(exc).split())  # tarfile's reasons can span lines
        raise UserError(f"cannot read archive {archive} ({reason}); it is incomplete or not a tar archive: delete "
                        f"it and rerun fetch") from None
    except OSError as exc:
        raise UserError(f"cannot extract {archive} into {root}: {exc.strerror or exc}; check the free space and "
                        f"permissions there") from None
    return files


# --------------------------------------------------------------------------------------------- verify

MAX_EXAMPLES = 3
MASK_SHAPES = ((IMAGE_SIZE, IMAGE_SIZE), (IMAGE_SIZE, IMAGE_SIZE, 1), (1, IMAGE_SIZE, IMAGE_SIZE))


class _Problems:
    """Problems grouped by where and what, so thousands of like ones read as one line with examples."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], list[str]] = {}

    def add(self, where: str, what: str, example: str | None = None) -> None:
        examples = self._groups.setdefault((where, what), [])
        if example is not None:
            examples.append(example)

    def lines(self) -> list[str]:
        lines = []
        for (where, what), examples in self._groups.items():
            if not examples:
                lines.append(f"{where}: {what}")
                continue
            shown = ", ".join(examples[:MAX_EXAMPLES])
            more = len(examples) - MAX_EXAMPLES
            lines.append(f"{where}: {len(examples)} {what}: {shown}" + (f", ... ({more} more)" if more > 0 else ""))
        return lines


@dataclass
class VerifyReport:
    """What `verify_layout` found: counts[folder][class] (variations and fg_mask) and the problems."""

    root: Path
    classes: list[str]
    counts: dict[str, dict[str, int]]
    problems: list[str]
    notes: list[str]
    images_checked: int
    decoded: bool
    masks_checked: int

    @property
    def ok(self) -> bool:
        return not self.problems

    def table(self) -> list[str]:
        classes = self.classes or sorted({c for per in self.counts.values() for c in per})
        first = max([len("variation"), *(len(name) for name in self.counts)])
        widths = [max(len(c), 5) for c in classes]
        lines = [" ".join(["variation".ljust(first), *(c.rjust(w) for c, w in zip(classes, widths)), "total".rjust(6)])]
        for name, per in self.counts.items():
            cells = [str(per[c]) if c in per else "-" for c in classes]
            lines.append(" ".join([name.ljust(first), *(v.rjust(w) for v, w in zip(cells, widths)),
                                   str(sum(per.values())).rjust(6)]))
        return lines

    def lines(self) -> list[str]:
        how = "decoded" if self.decoded else "header-checked (pass --full to decode every image)"
        lines = [f"{self.root}: {self.images_checked} images {how}, {self.masks_checked} masks loaded", *self.table()]
        lines.extend(f"note: {note}" for note in self.notes)
        if self.problems:
            lines.append(f"{len(self.problems)} problem(s):")
            lines.extend(f"  {p}" for p in self.problems)
        else:
            lines.append("no problems found")
        return lines


def _list_folder(folder: Path) -> tuple[list[str], list[str]]:
    """(sorted sub-folder names, sorted file names), hidden entries left out."""
    dirs, files = [], []
    with os.scandir(folder) as it:
        for entry in it:
            if entry.name.startswith("."):
                continue
            (dirs if entry.is_dir() else files).append(entry.name)
    return sorted(dirs), sorted(files)


def _check_image(path: Path, decode: bool) -> tuple[str, str] | None:
    """(what, example) when the image is unreadable or not IMAGE_SIZE square, else None."""
    try:
        with Image.open(path) as img:
            size = img.size
            if decode:
                img.load()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        return "unreadable image(s)", f"{path.name} ({exc})"
    if size != (IMAGE_SIZE, IMAGE_SIZE):
        return f"image(s) not {IMAGE_SIZE}x{IMAGE_SIZE}", f"{path.name} ({size[0]}x{size[1]})"
    return None


def _check_mask(path: Path, load: bool) -> tuple[str, str] | None:
    """(what, example) when the mask is unreadable, of the wrong shape or type, or not 0/1, else None."""
    try:
        array = np.load(path, mmap_mode=None if load else "r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        return "unreadable mask(s)", f"{path.name} ({exc})"
    if array.shape not in MASK_SHAPES:
        return f"mask(s) not of shape ({IMAGE_SIZE}, {IMAGE_SIZE})", f"{path.name} {array.shape}"
    if not (array.dtype == np.bool_ or np.issubdtype(array.dtype, np.integer)
            or np.issubdtype(array.dtype, np.floating)):
        return "mask(s) of a non-numeric dtype", f"{path.name} ({array.dtype})"
    if load and array.dtype != np.bool_:
        values = np.unique(array)
        if not np.isin(values, (0, 1)).all():
            return "mask(s) with values other than 0 and 1", f"{path.name} ({', '.join(map(str, values[:4]))})"
    return None


def _is_listed(folder_name: str, file_name: str) -> bool:
    """Whether the scripts read the file: .npy in fg_mask, an image extension (any case) elsewhere."""
    if folder_name == MASK_FOLDER:
        return file_name.endswith(MASK_EXTENSION)
    return file_name.lower().endswith(IMAGE_EXTENSIONS)


def _run_checks(check, paths: list[Path], workers: int, progress: bool, desc: str) -> list[tuple[Path, tuple]]:
    results = map_in_threads(check, paths, workers, progress, desc)
    return [(path, result) for path, result in zip(paths, results) if result is not None]


def _compare_with_original(listings: dict[str, dict[str, list[str]]], original: dict[str, list[str]],
                           problems: _Problems, notes: list[str]) -> None:
    """Every variation has as many images per class as original (a problem if not). Where the variations
    made from one image (only_fg, ..., no_fg) name theirs differently from original, that is a note:
    nothing the scripts rely on."""
    for name, per in listings.items():
        if name in (Variation.ORIGINAL.value, MASK_FOLDER):
            continue
        renamed = 0
        for cls, files in per.items():
            if cls not in original:
                continue
            if len(files) != len(original[cls]):
                problems.add(f"{name}/{SPLIT}/{cls}", f"{len(files)} images where original has {len(original[cls])}")
            if name not in MIXED:
                renamed += len({Path(f).stem for f in files} - {Path(f).stem for f in original[cls]})
        if renamed:
            notes.append(f"{name}/{SPLIT}: {renamed} image stem(s) that original does not have")


def _scan(root: Path, names: Sequence[str], need_masks: bool, images: str, load_masks: bool, compare_counts: bool,
          workers: int, progress: bool) -> VerifyReport:
    """The one walk behind verify_layout and quick_check. images: 'sample' (first per class), 'header', 'full'."""
    root = check_data_root(root)
    problems, notes = _Problems(), []
    names = list(dict.fromkeys([*names, *((Variation.ORIGINAL.value, MASK_FOLDER) if need_masks else ())]))
    listings: dict[str, dict[str, list[str]]] = {}  # folder -> class -> kept files
    for name in names:
        folder = root / name / SPLIT
        where = f"{name}/{SPLIT}"
        if not folder.is_dir():
            problems.add(where, f"missing: no folder {folder}")
            continue
        classes, stray = _list_folder(folder)
        if stray:
            notes.append(f"{where}: {len(stray)} file(s) outside the class folders, ignored ({stray[0]}, ...)")
        listings[name] = {}
        for cls in classes:
            _, files = _list_folder(folder / cls)
            kept = [f for f in files if _is_listed(name, f)]
            if len(kept) < len(files):
                other = [f for f in files if not _is_listed(name, f)]
                notes.append(f"{where}/{cls}: {len(other)} file(s) of another type, ignored ({other[0]}, ...)")
            if not kept:
                problems.add(f"{where}/{cls}", f"no {'masks' if name == MASK_FOLDER else 'images'}")
            listings[name][cls] = kept

    reference_name = next((n for n in (Variation.ORIGINAL.value, *listings) if n in listings), None)
    reference = list(listings[reference_name]) if reference_name else []
    for name, per in listings.items():
        count = "" if len(per) == NUM_IN9_CLASSES else f"{len(per)} class folders, expected {NUM_IN9_CLASSES}"
        if list(per) != reference:
            missing = [c for c in reference if c not in per]
            extra = [c for c in per if c not in reference]
            problems.add(f"{name}/{SPLIT}", f"class folders differ from those of {reference_name}/{SPLIT}: missing "
                                            f"{', '.join(missing) or 'none'}; extra {', '.join(extra) or 'none'}"
                                            + (f" ({count})" if count else ""))
        elif count:
            problems.add(f"{name}/{SPLIT}", f"{count} ({', '.join(per) or 'none'})")

    original = listings.get(Variation.ORIGINAL.value, {})
    original_stems = {cls: {Path(f).stem for f in files} for cls, files in original.items()}
    for cls, files in listings.get(MASK_FOLDER, {}).items():
        if cls not in original_stems:
            continue
        stems = {Path(f).stem for f in files}
        for stem in sorted(stems - original_stems[cls]):
            problems.add(f"{MASK_FOLDER}/{SPLIT}/{cls}", "mask(s) without an original image", stem)
        for stem in sorted(original_stems[cls] - stems):
            problems.add(f"{MASK_FOLDER}/{SPLIT}/{cls}", "original image(s) without a mask", stem)
    if compare_counts:
        _compare_with_original(listings, original, problems, notes)

    image_paths, mask_paths = [], []
    for name, per in listings.items():
        for cls, files in per.items():
            chosen = files[:1] if images == "sample" or (name == MASK_FOLDER and not load_masks) else files
            (mask_paths if name == MASK_FOLDER else image_paths).extend(root / name / SPLIT / cls / f for f in chosen)
    decode = images == "full"
    found = _run_checks(lambda p: _check_image(p, decode), image_paths, workers, progress, "images")
    found += _run_checks(lambda p: _check_mask(p, load_masks), mask_paths, workers, progress, "masks")
    for path, (what, example) in found:
        problems.add(path.parent.relative_to(root).as_posix(), what, example)

    counts = {name: {cls: len(files) for cls, files in per.items()} for name, per in listings.items()}
    return VerifyReport(root, reference, counts, problems.lines(), notes, len(image_paths), decode,
                        len(mask_paths) if load_masks else 0)


def verify_layout(root: Path, full: bool = False, workers: int | None = None, progress: bool = False) -> VerifyReport:
    """Check everything both scripts need and collect every problem.

    The eight variations and fg_mask each with the same nine class folders, none empty; as many images
    per class in every variation as in original; every image readable and IMAGE_SIZE square (its
    header only, unless `full` decodes it); every mask a .npy of shape (224, 224) (or with a unit axis) holding
    booleans or 0/1, paired with its original image and the other way round.
    """
    return _scan(root, VARIATIONS, need_masks=True, images="full" if full else "header", load_masks=True,
                 compare_counts=True, workers=workers or default_workers(), progress=progress)


def quick_check(root: Path, variations: Sequence[str], need_masks: bool = False) -> dict[str, int]:
    """The fast check the scripts run before they start; returns the file count per folder checked.

    Directory listings only, plus the header of the first image (and mask) of each class: every named
    variation has nine class folders, none empty, named alike in every folder checked (as in original
    when it is among them), the sampled images are IMAGE_SIZE square, and with need_masks original/
    and fg_mask/ are checked too and pair one mask with every original image. Raises UserError with
    the first problem; counts across variations and full decoding are left to `verify_layout`.
    """
    report = _scan(root, variations, need_masks, images="sample", load_masks=False, compare_counts=False, workers=1,
                   progress=False)
    if report.problems:
        more = f" (and {len(report.problems) - 1} more problem(s))" if len(report.problems) > 1 else ""
        raise UserError(f"data in {report.root}: {report.problems[0]}{more}; run `python -m tools.data verify "
                        f"--data-path {report.root}` for the full list")
    return {name: sum(per.values()) for name, per in report.counts.items()}


# ---------------------------------------------------------------------------------------------- build

MAX_BOX_FRACTION = 0.9  # of the crop's area
MIN_BOX_INSIDE = 0.5  # of the resized box's area inside the crop
MIN_FOREGROUND_FRACTION = 0.1  # of the box's area
DEFAULT_JPEG_QUALITY = 95
SUMMARY_NAME = "build_summary.json"


class ImageFormat(str, enum.Enum):
    JPEG = "jpeg"
    PNG = "png"


EXTENSIONS = {ImageFormat.JPEG: ".JPEG", ImageFormat.PNG: ".png"}
USER_MASK_EXTENSIONS = (".npy", ".png")


class DropReason(str, enum.Enum):
    """Why an image was left out, in the order the filters run."""

    NO_BOX = "no_box"
    SEVERAL_BOXES = "several_boxes"
    UNREADABLE = "unreadable"
    EMPTY_BOX = "empty_box"
    BOX_TOO_LARGE = "box_too_large"
    BOX_OUTSIDE_CROP = "box_outside_crop"
    NO_MASK = "no_mask"
    GRABCUT_FAILED = "grabcut_failed"
    SMALL_FOREGROUND = "small_foreground"


@dataclass(frozen=True)
class SourceImage:
    path: Path
    label: int
    folder: str

    @property
    def stem(self) -> str:
        return self.path.stem

    @property
    def key(self) -> str:
        return f"{self.folder}/{self.stem}"


@dataclass
class BuiltImage:
    """A kept image: its box in the crop, its packed mask, and the images whose backgrounds it was mixed with."""

    source: SourceImage
    box: variations.Box
    foreground_fraction: float
    packed_mask: np.ndarray
    source_size: tuple[int, int]  # (width, height) of the original image
    backgrounds: dict[str, int] = field(default_factory=dict)  # mixed variation -> index into BuildResult.kept

    def mask(self) -> np.ndarray:
        return np.unpackbits(self.packed_mask, count=IMAGE_SIZE * IMAGE_SIZE).reshape(IMAGE_SIZE, IMAGE_SIZE) != 0


@dataclass
class BuildResult:
    out: Path
    config: dict
    classes: list[str]
    total: int
    kept: list[BuiltImage]
    dropped: dict[DropReason, list[str]]
    boxes_rescaled: int = 0
    same_class_fallbacks: list[str] = field(default_factory=list)

    def background_of(self, image: BuiltImage, variation: str) -> BuiltImage:
        return self.kept[image.backgrounds[variation]]

    def summary(self) -> dict:
        return {
            "config": self.config,
            "input_images": self.total,
            "kept": len(self.kept),
            "dropped": {reason.value: len(self.dropped.get(reason, [])) for reason in DropReason},
            "kept_per_class": {cls: sum(1 for k in self.kept if k.source.folder == cls) for cls in self.classes},
            "boxes_rescaled": self.boxes_rescaled,
            "mixed_same_fallbacks": self.same_class_fallbacks,
            "dropped_images": {reason.value: self.dropped[reason] for reason in DropReason if reason in self.dropped},
            "images": [{"image": k.source.key, "label": k.source.label, "box": list(k.box),
                        "foreground_fraction": round(k.foreground_fraction, 4),
                        **{v: self.kept[i].source.key for v, i in k.backgrounds.items()}} for k in self.kept],
        }

    def lines(self) -> list[str]:
        dropped = sum(len(v) for v in self.dropped.values())
        lines = [f"built {self.out} from {self.total} images: kept {len(self.kept)}, dropped {dropped}"]
        lines.extend(f"  dropped, {reason.value}: {len(self.dropped[reason])}" for reason in DropReason
                     if self.dropped.get(reason))
        per_class = self.summary()["kept_per_class"]
        lines.append("  kept per class: " + ", ".join(f"{cls} {n}" for cls, n in per_class.items()))
        if self.boxes_rescaled:
            lines.append(f"  boxes rescaled from the size their XML declares: {self.boxes_rescaled}")
        if self.same_class_fallbacks:
            lines.append(f"  mixed_same used the image's own background (no other image of its class): "
                         f"{len(self.same_class_fallbacks)}")
        lines.append(f"summary: {self.out / SUMMARY_NAME}")
        return lines


def variation_arrays(crop: np.ndarray, box: variations.Box, mask: np.ndarray,
                     backgrounds: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The variations of one crop, before any encoding.

    `backgrounds` maps each mixed variation to the only_bg_t array of the image whose background it
    takes; the image's foreground (its mask region) is laid over it.
    """
    out = {
        Variation.ORIGINAL.value: crop,
        Variation.ONLY_FG.value: variations.only_fg(crop, mask),
        Variation.ONLY_BG_B.value: variations.only_bg_b(crop, box),
        Variation.ONLY_BG_T.value: variations.only_bg_t(crop, box),
        Variation.NO_FG.value: variations.no_fg(crop, mask),
    }
    for name, background in (backgrounds or {}).items():
        out[name] = variations.composite(background, crop, mask)
    return out


def list_sources(images: Path) -> tuple[list[str], list[SourceImage]]:
    """The nine class folders of --images (sorted: the order is the class index) and their images."""
    images = Path(images)
    if not images.is_dir():
        raise UserError(f"--images {images} is not a folder; pass the folder holding one sub-folder per IN-9 class")
    classes, _ = _list_folder(images)
    if len(classes) != NUM_IN9_CLASSES:
        raise UserError(f"--images {images} has {len(classes)} class folders, expected {NUM_IN9_CLASSES} "
                        f"({', '.join(classes) or 'none'}); their sorted order gives the class index")
    sources, seen = [], {}
    for label, cls in enumerate(classes):
        _, files = _list_folder(images / cls)
        for name in files:
            if not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            source = SourceImage(images / cls / name, label, cls)
            if source.stem in seen:
                raise UserError(f"two images share the stem {source.stem}: {seen[source.stem]} and {source.path}; "
                                f"boxes and masks are matched by stem, so rename one")
            seen[source.stem] = source.path
            sources.append(source)
    if not sources:
        raise UserError(f"--images {images} holds no images in its class folders")
    return classes, sources


def _index_user_masks(folder: Path) -> dict[str, Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--masks {folder} is not a folder; pass the folder of <stem>.npy or <stem>.png masks")
    index: dict[str, Path] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and path.suffix.lower() in USER_MASK_EXTENSIONS:
            if path.stem in index:
                raise UserError(f"two masks for {path.stem}: {index[path.stem]} and {path}; keep one")
            index[path.stem] = path
    return index


def load_user_mask(path: Path, geometry: boxes_mod.CropGeometry) -> np.ndarray:
    """A user's mask (.npy or .png; non-zero is foreground) in the crop's pixels.

    A mask the size of the original image is resized (nearest neighbour) and cropped with it; one of
    IMAGE_SIZE x IMAGE_SIZE that is not the original's size is taken as already in the crop's pixels.
    """
    try:
        if path.suffix.lower() == ".png":
            with Image.open(path) as img:
                raw = np.asarray(img.convert("L"))
        else:
            raw = np.load(path, allow_pickle=False)
    except (OSError, ValueError, UnidentifiedImageError) as exc:
        raise UserError(f"cannot read mask {path}: {exc}; masks are .npy arrays or .png images") from None
    if raw.ndim == 3 and raw.shape[-1] == 1:
        raw = raw[..., 0]
    if not (raw.dtype == np.bool_ or np.issubdtype(raw.dtype, np.integer) or np.issubdtype(raw.dtype, np.floating)):
        raise UserError(f"mask {path} has dtype {raw.dtype}; masks hold booleans or numbers (non-zero is foreground)")
    mask = raw != 0
    if mask.shape == (geometry.height, geometry.width):
        return geometry.mask(mask)
    if mask.shape == (geometry.size, geometry.size):
        return mask
    raise UserError(f"mask {path} has shape {raw.shape}; it must match its image ({geometry.height}, {geometry.width}) "
                    f"or be already cropped ({geometry.size}, {geometry.size})")


def _open_rgb(path: Path) -> Image.Image | None:
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        log.warning("cannot read %s (%s); left out", path, exc)
        return None


@dataclass
class _Prepared:
    geometry: boxes_mod.CropGeometry
    crop: np.ndarray
    box: variations.Box


def _prepare(source: SourceImage, entry: boxes_mod.BoxEntry | None) -> _Prepared | DropReason:
    """Decode, resize and crop one image and apply the box filters (the mask comes later)."""
    if entry is None or not entry.boxes:
        return DropReason.NO_BOX
    if len(entry.boxes) > 1:
        return DropReason.SEVERAL_BOXES
    img = _open_rgb(source.path)
    if img is None:
        return DropReason.UNREADABLE
    geometry = boxes_mod.CropGeometry.for_image(*img.size)
    (box,) = entry.boxes_for(*img.size)
    if entry.declared_size is not None and entry.declared_size != img.size:
        log.debug("%s: box rescaled from the declared size %s to %s", source.path, entry.declared_size, img.size)
    if boxes_mod.box_area(box) <= 0:
        return DropReason.EMPTY_BOX
    moved = geometry.box(box)
    inside = boxes_mod.clip_box(moved, geometry.size)
    if boxes_mod.box_area(inside) > MAX_BOX_FRACTION * geometry.size ** 2:
        return DropReason.BOX_TOO_LARGE
    if boxes_mod.box_area(inside) < MIN_BOX_INSIDE * boxes_mod.box_area(moved):
        return DropReason.BOX_OUTSIDE_CROP
    return _Prepared(geometry, geometry.image(img), boxes_mod.pixel_box(inside, geometry.size))


def crop_image(path: Path) -> np.ndarray:
    """An image file resized and centre-cropped exactly as `build` does it (no filters)."""
    img = _open_rgb(path)
    if img is None:
        raise UserError(f"cannot read image {path}; replace or remove it")
    return boxes_mod.CropGeometry.for_image(*img.size).image(img)


def _filter_and_mask(source: SourceImage, entry: boxes_mod.BoxEntry | None, user_masks: dict[str, Path] | None,
                     iterations: int, seed: int) -> BuiltImage | DropReason:
    """One image through the filters: the box filters, then the mask (the user's or GrabCut's) and its size."""
    prepared = _prepare(source, entry)
    if isinstance(prepared, DropReason):
        return prepared
    if user_masks is not None:
        if source.stem not in user_masks:
            return DropReason.NO_MASK
        mask = load_user_mask(user_masks[source.stem], prepared.geometry)
    else:
        try:
            mask = grabcut.grabcut_mask(prepared.crop, prepared.box, iterations, seed)
        except ValueError as exc:
            log.warning("GrabCut failed on %s (%s); left out", source.path, exc)
            return DropReason.GRABCUT_FAILED
    x0, y0, x1, y1 = prepared.box
    fraction = float(mask.sum()) / ((x1 - x0) * (y1 - y0))
    if fraction < MIN_FOREGROUND_FRACTION:
        return DropReason.SMALL_FOREGROUND
    size = (prepared.geometry.width, prepared.geometry.height)
    return BuiltImage(source, prepared.box, fraction, np.packbits(mask), size)


def build(images: Path, boxes: Path, out: Path, masks: Path | None = None, seed: int = 0,
          jpeg_quality: int = DEFAULT_JPEG_QUALITY, image_format: ImageFormat = ImageFormat.JPEG,
          grabcut_iterations: int = grabcut.DEFAULT_ITERATIONS, workers: int | None = None,
          progress: bool = True) -> BuildResult:
    """Make the eight variations and fg_mask in the release's layout under `out` (see the module docstring).

    Nothing is written until every image has been through the filters and every class kept at least
    one image; `out` must be empty or new. `workers` threads (default: up to 8) decode, segment and write.
    """
    out = Path(out)
    workers = workers or default_workers()
    image_format = ImageFormat(image_format)
    if not 1 <= jpeg_quality <= 100:
        raise UserError(f"--jpeg-quality must be between 1 and 100, not {jpeg_quality}")
    if grabcut_iterations < 1:
        raise UserError(f"--grabcut-iterations must be at least 1, not {grabcut_iterations}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} exists and is not an empty folder; build never overwrites: pass a new folder")
    classes, sources = list_sources(images)
    entries = boxes_mod.read_boxes(boxes)
    user_masks = _index_user_masks(masks) if masks is not None else None
    if user_masks is None:
        grabcut.require_opencv()
    unknown = len(set(entries) - {s.stem for s in sources})
    if unknown:
        log.info("%d box entries name no image under %s; ignored", unknown, images)

    def filter_and_mask(source: SourceImage) -> BuiltImage | DropReason:
        return _filter_and_mask(source, entries.get(source.stem), user_masks, grabcut_iterations, seed)

    kept: list[BuiltImage] = []
    dropped: dict[DropReason, list[str]] = defaultdict(list)
    for source, outcome in zip(sources, map_in_threads(filter_and_mask, sources, workers, progress, "filter, mask")):
        if isinstance(outcome, DropReason):
            dropped[outcome].append(source.key)
        else:
            kept.append(outcome)

    empty = [cls for label, cls in enumerate(classes) if not any(k.source.label == label for k in kept)]
    if empty:
        raise UserError(f"no image of class(es) {', '.join(empty)} passed the filters, and every class folder needs "
                        f"at least one image; add images or boxes for them (nothing was written to {out})")

    config = {"images": str(images), "boxes": str(boxes), "masks": None if masks is None else str(masks),
              "mask_source": "grabcut" if user_masks is None else "masks", "seed": seed,
              "image_format": image_format.value, "jpeg_quality": jpeg_quality,
              "grabcut_iterations": grabcut_iterations if user_masks is None else None,
              "resize": boxes_mod.RESIZE_SIZE, "crop": IMAGE_SIZE, "max_box_fraction": MAX_BOX_FRACTION,
              "min_box_inside": MIN_BOX_INSIDE, "min_foreground_fraction": MIN_FOREGROUND_FRACTION}
    rescaled = sum(1 for k in kept if entries[k.source.stem].declared_size not in (None, k.source_size))
    result = BuildResult(out, config, classes, len(sources), kept, dict(dropped), rescaled)
    _choose_backgrounds(result, seed)
    _write(result, image_format, jpeg_quality, workers, progress)
    write_json_atomic(out / SUMMARY_NAME, result.summary())
    return result


def _choose_backgrounds(result: BuildResult, seed: int) -> None:
    """Seeded choices: another image of the same class, of a random class, and of the next class."""
    rng = np.random.default_rng(seed)
    by_class = [[i for i, k in enumerate(result.kept) if k.source.label == c] for c in range(NUM_IN9_CLASSES)]

    def pick(pool: list[int]) -> int:
        return pool[int(rng.integers(len(pool)))]

    for i, image in enumerate(result.kept):
        label = image.source.label
        same = [j for j in by_class[label] if j != i]
        if not same:
            result.same_class_fallbacks.append(image.source.key)
            same = [i]
        random_class = int(rng.integers(NUM_IN9_CLASSES))
        anywhere = [j for j in by_class[random_class] if j != i] or by_class[random_class]
        image.backgrounds = {
            Variation.MIXED_SAME.value: pick(same),
            Variation.MIXED_RAND.value: pick(anywhere),
            Variation.MIXED_NEXT.value: pick(by_class[(label + 1) % NUM_IN9_CLASSES]),
        }
    if result.same_class_fallbacks:
        log.warning("%d image(s) are the only ones kept in their class; their mixed_same uses their own background",
                    len(result.same_class_fallbacks))


def _write(result: BuildResult, image_format: ImageFormat, quality: int, workers: int, progress: bool) -> None:
    extension = EXTENSIONS[image_format]
    for name in LAYOUT_NAMES:
        for cls in result.classes:
            (result.out / name / SPLIT / cls).mkdir(parents=True, exist_ok=True)

    def write_one(image: BuiltImage) -> None:
        # the crops are made again from the files rather than kept: memory stays flat for any number of images
        crop, mask = crop_image(image.source.path), image.mask()
        backgrounds = {}
        for variation in MIXED:
            other = result.background_of(image, variation)
            backgrounds[variation] = variations.only_bg_t(crop_image(other.source.path), other.box)
        for name, array in variation_arrays(crop, image.box, mask, backgrounds).items():
            target = result.out / name / SPLIT / image.source.folder / f"{image.source.stem}{extension}"
            if image_format is ImageFormat.JPEG:
                Image.fromarray(array).save(target, format="JPEG", quality=quality)
            else:
                Image.fromarray(array).save(target, format="PNG", compress_level=1)  # lossless at any level
        np.save(result.out / MASK_FOLDER / SPLIT / image.source.folder / f"{image.source.stem}{MASK_EXTENSION}", mask)

    for _ in map_in_threads(write_one, result.kept, workers, progress, "write"):
        pass


# ------------------------------------------------------------------------------------------------ CLI

def _sha256_arg(value: str) -> str:
    if not re.fullmatch(r"[0-9a-fA-F]{64}", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a SHA-256 (64 hexadecimal digits)")
    return value.lower()


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--no-progress", action="store_true", help="hide progress bars (default: shown)")
    add_log_level_argument(common)
    parser = argparse.ArgumentParser(prog="python -m tools.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="{fetch,verify,build}")

    fetch_p = commands.add_parser("fetch", parents=[common], help="download, check and extract the IN-9 test release",
                                  description="Download the release archive (resuming a partial download), check "
                                              "its SHA-256 and extract it safely into --data-path.")
    fetch_p.add_argument("--data-path", type=Path, required=True, metavar="DIR",
                         help="folder to hold original/, ..., fg_mask/ (created if missing)")
    fetch_p.add_argument("--url", default=RELEASE_URL, metavar="URL",
                         help=f"archive to download (default: {RELEASE_URL})")
    fetch_p.add_argument("--sha256", type=_sha256_arg, default=None, metavar="HEX",
                         help="expected SHA-256 of the archive (default: the release's, unless --url names another "
                              "source, when the check is skipped with a warning)")
    fetch_p.add_argument("--archive", type=Path, default=None, metavar="FILE",
                         help="extract this already downloaded archive instead of downloading (default: download)")
    fetch_p.add_argument("--keep-archive", action="store_true",
                         help="keep the downloaded archive in --data-path after extracting it (default: delete it)")
    fetch_p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                         help=f"network timeout (default: {DEFAULT_TIMEOUT_S:g})")
    fetch_p.set_defaults(handler=_run_fetch)

    verify_p = commands.add_parser("verify", parents=[common], help="check a data folder and count its images",
                                   description="Check the layout both scripts read; print a variation x class table "
                                               "and every problem; exit 2 if there is any.")
    verify_p.add_argument("--data-path", type=Path, required=True, metavar="DIR",
                          help="folder holding original/, ..., fg_mask/")
    verify_p.add_argument("--full", action="store_true",
                          help="decode every image (default: read image headers only, which finds wrong sizes and "
                               "non-images but not truncated files)")
    verify_p.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                          help=f"threads reading files (default: {default_workers()})")
    verify_p.set_defaults(handler=_run_verify)

    build_p = commands.add_parser("build", parents=[common], help="make the variations from images with boxes",
                                  description="Make the eight variations and fg_mask from labelled images with one "
                                              "bounding box each, as in the paper's Appendix A.")
    build_p.add_argument("--images", type=Path, required=True, metavar="DIR",
                         help="folder with one sub-folder per IN-9 class (sorted order = class index)")
    build_p.add_argument("--boxes", type=Path, required=True, metavar="PATH",
                         help="folder of Pascal VOC .xml files (1-based inclusive coordinates) or a CSV file "
                              "image,xmin,ymin,xmax,ymax (0-based pixels, xmax/ymax exclusive)")
    build_p.add_argument("--out", type=Path, required=True, metavar="DIR", help="new or empty output folder")
    build_p.add_argument("--masks", type=Path, default=None, metavar="DIR",
                         help="your own foreground masks <stem>.npy or <stem>.png, at the original image's size or "
                              "224x224 (default: GrabCut from the box, which needs OpenCV)")
    build_p.add_argument("--seed", type=int, default=0, metavar="N",
                         help="seed for the mixed backgrounds and GrabCut (default: 0)")
    build_p.add_argument("--jpeg-quality", type=int, default=DEFAULT_JPEG_QUALITY, metavar="Q",
                         help=f"JPEG quality 1-100 (default: {DEFAULT_JPEG_QUALITY})")
    build_p.add_argument("--image-format", type=ImageFormat, choices=list(ImageFormat), default=ImageFormat.JPEG,
                         metavar="{" + ",".join(f.value for f in ImageFormat) + "}",
                         help="jpeg writes <stem>.JPEG as the release; png is lossless (default: jpeg)")
    build_p.add_argument("--grabcut-iterations", type=int, default=grabcut.DEFAULT_ITERATIONS, metavar="N",
                         help=f"GrabCut iterations (default: {grabcut.DEFAULT_ITERATIONS})")
    build_p.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                         help=f"threads decoding, segmenting and writing images (default: {default_workers()})")
    build_p.set_defaults(handler=_run_build)
    return parser


def _run_fetch(args: argparse.Namespace) -> int:
    if args.url != RELEASE_URL and args.sha256 is None and args.archive is None:
        log.warning("--url without --sha256: the download's SHA-256 will be reported but not checked")
    result = fetch(args.data_path, args.url, args.sha256, args.keep_archive, args.archive, not args.no_progress,
                   args.timeout)
    print("\n".join(result.lines()))
    return 0


def _run_verify(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, not {args.workers}")
    report = verify_layout(args.data_path, args.full, args.workers, not args.no_progress)
    print("\n".join(report.lines()))
    if report.problems:
        raise UserError(f"{len(report.problems)} problem(s) in {report.root}, listed above; fix them or rerun "
                        f"`python -m tools.data fetch` / `build`")
    return 0


def _run_build(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UserError(f"--workers must be at least 1, not {args.workers}")
    result = build(args.images, args.boxes, args.out, args.masks, args.seed, args.jpeg_quality, args.image_format,
                   args.grabcut_iterations, args.workers, not args.no_progress)
    print("\n".join(result.lines()))
    return 0


def main(argv: Iterable[str] | None = None) -> int:
    """Run one command; a user error is one line on stderr and exit code 2."""
    return run_main(build_parser(), lambda args: args.handler(args), None if argv is None else list(argv),
                    on_interrupt="rerun the same command (fetch resumes its partial download; build needs an "
                                 "empty --out)")


if __name__ == "__main__":
    sys.exit(main())
