"""Getting the IN-9 test release: download (resuming a partial one), check its SHA-256, extract it safely."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import logging
import os
import re
import shutil
import stat
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tools import __version__
from tools.data.check import VerifyReport, quick_scan
from tools.data.hashing import sha256_file
from tools.data.layout import LAYOUT_NAMES
from tools.data.temporary import temporary_folder
from tools.errors import UserError
from tools.in9 import MASK_FOLDER, VARIATIONS
from tools.progress import progress_bar
from tools.provenance import open_own

log = logging.getLogger(__name__)

RELEASE_URL = ("https://github.com/MadryLab/backgrounds_challenge/releases/download/data/"
               "backgrounds_challenge_data.tar.gz")
RELEASE_SIZE = 279_581_133
RELEASE_SHA256 = "2d66f571b0492986b347e37d2ee498ed34b58012af425d772dacda4422896fe7"
ARCHIVE_NAME = "backgrounds_challenge_data.tar.gz"
PART_SUFFIX = ".part"
BAD_SUFFIX = ".bad"
CHUNK_SIZE = 1 << 20
DEFAULT_TIMEOUT_S = 60.0
EXTRACT_PREFIX = ".extract-"  # <data-path>/.extract-<host>-<pid>-<random> holds an extraction until it has passed


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
    """Download (or take `archive`), check the SHA-256 (`sha256`, else the release's own for the release URL;
    skipped with a warning otherwise) and extract the release into `data_path`; one already there is checked alike
    and left. A download is deleted (unless `keep_archive`) only once extracted; a user's `archive` never is."""
    root = Path(data_path)
    present = [name for name in LAYOUT_NAMES if (root / name).exists()]
    if len(present) == len(LAYOUT_NAMES):
        report = check_release(root)
        if report.problems:
            raise UserError(f"{root} already holds every variation and {MASK_FOLDER}/, but they are not a usable "
                            f"release: {report.first_problem()}; remove those folders and rerun fetch, or run "
                            f"`python -m tools.data verify --data-path {root}` for the full list")
        return FetchResult(root, url, None, False, already_present=True, counts=_file_counts(report))
    if present:
        raise UserError(f"{root} already holds part of a dataset ({', '.join(present)}); remove those folders or "
                        f"pass an empty --data-path, then rerun fetch")
    with _created(root):
        return _fetch_into(root, url, sha256, keep_archive, archive, progress, timeout)


@contextlib.contextmanager
def _created(root: Path) -> Iterator[None]:
    """`root` created for the block; where the block fails, the folders it created that are still empty are removed
    (one holding a partial or moved-aside download stays)."""
    created = [folder for folder in (root, *root.parents) if not folder.exists()]  # the deepest first
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create --data-path {root}: {exc.strerror}; pass a folder you can write to") from None
    try:
        yield
    except BaseException:
        for folder in created:
            try:
                folder.rmdir()  # only an empty folder
            except OSError:
                break
        raise


def _fetch_into(root: Path, url: str, sha256: str | None, keep_archive: bool, archive: Path | None, progress: bool,
                timeout: float) -> FetchResult:
    """`fetch` once `root` exists and holds none of the release."""
    expected = sha256.lower() if sha256 else (RELEASE_SHA256 if url == RELEASE_URL else None)

    if archive is not None:
        archive = Path(archive)
        if not archive.is_file():
            raise UserError(f"--archive {archive} is not a file; pass the downloaded {ARCHIVE_NAME}")
        digest = _check_sha256(archive, expected, str(archive), move_aside=False)
        files, counts = extract_archive(archive, root, progress, downloaded=False)
        return FetchResult(root, str(archive), digest, expected is not None, files=files, archive_kept=archive,
                           counts=counts)
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
    files, counts = extract_archive(dest, root, progress, downloaded=True)
    if not keep_archive:
        dest.unlink()
    return FetchResult(root, url, digest, expected is not None, downloaded, resumed, files,
                       dest if keep_archive else None, counts=counts)


def check_release(root: Path) -> VerifyReport:
    """The one check of a release before fetch calls it fetched: `quick_scan` of every variation with the masks."""
    return quick_scan(root, VARIATIONS, need_masks=True)


def _file_counts(report: VerifyReport) -> dict[str, int]:
    return {name: sum(per.values()) for name, per in report.counts.items()}


def _check_sha256(path: Path, expected: str | None, source: str, move_aside: bool) -> str:
    try:
        digest = sha256_file(path)
    except OSError as exc:
        what = str(path) if move_aside else f"--archive {path}"
        raise UserError(f"cannot read {what}: {exc.strerror or exc}; make it readable, or pass another copy of the "
                        f"release archive") from None
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
    """Download `url` into `part`, resuming from what it holds; returns (bytes fetched, resumed). A 200 answer to
    a Range request restarts from the start; connection failures are a UserError naming where to put a manual
    download (`dest`); a transfer that stops midway keeps `part`."""
    try:
        found = os.lstat(part)  # the link itself, if one is there
    except FileNotFoundError:
        found = None
    if found is not None and not stat.S_ISREG(found.st_mode):
        raise UserError(f"{part} is not a partial download (fetch writes a plain file there, and this is a link or "
                        f"a special file), so nothing is written through it; remove it and rerun")
    offset = found.st_size if found is not None else 0
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
        with _open_part(part, offset) as fh, \
                progress_bar(total=total, initial=offset, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=dest.name, disable=not progress, leave=False) as bar:
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


def _open_part(part: Path, offset: int):
    """The partial download, opened to append after `offset` bytes (or emptied), never through a link."""
    try:
        return open_own(part, append=bool(offset))
    except OSError as exc:
        raise UserError(f"cannot write {part} ({exc.strerror or exc}); remove it and rerun") from None


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
    """Each member with its path inside the target, the archive's single top folder stripped. Refuses the whole
    archive, before anything is written, when any member is a link, a special file, absolute or has '..'."""
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


def extract_archive(archive: Path, root: Path, progress: bool = True,
                    downloaded: bool = True) -> tuple[int, dict[str, int]]:
    """Extract the release archive into `root`, its top folder stripped; returns the file count and files per
    folder. Plain files and folders, in a temporary folder moved into place only once `check_release` passes.
    `downloaded`: fetch's own download, not a user's --archive (for the messages)."""
    root = Path(root)
    what = str(archive) if downloaded else f"--archive {archive}"
    try:
        with tarfile.open(archive, "r:*") as tar, temporary_folder(root, EXTRACT_PREFIX) as tmp:
            plan = plan_extraction(tar.getmembers(), archive)
            if not plan:
                raise UserError(f"{what} is an empty archive; pass the release archive")
            files = _extract_members(tar, plan, tmp, archive, progress)
            report = check_release(tmp)
            if report.problems:
                kept = (f"the archive is kept at {archive} (delete it to download again)" if downloaded else
                        "the archive was left in place")
                raise UserError(f"{what} is not a usable release: {report.first_problem()}; nothing was extracted "
                                f"into {root}, {kept}; pass the release archive")
            for entry in sorted(tmp.iterdir()):
                if (root / entry.name).exists():
                    log.warning("kept the existing %s; the archive's copy was not extracted", root / entry.name)
                    continue
                os.replace(entry, root / entry.name)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        reason = " ".join(str(exc).split())  # tarfile's reasons can span lines
        advice = ("delete it and rerun fetch to download it again" if downloaded else
                  "pass a complete copy of the release archive")
        raise UserError(f"cannot read {what} ({reason}): it is incomplete or not a tar archive; {advice}") from None
    except OSError as exc:
        raise UserError(f"cannot extract {what} into {root}: {exc.strerror or exc}; check that the archive can be "
                        f"read and the free space and permissions in {root}") from None
    return files, _file_counts(report)


def _extract_members(tar: tarfile.TarFile, plan: list[tuple[tarfile.TarInfo, tuple[str, ...]]], folder: Path,
                     archive: Path, progress: bool) -> int:
    """Write the planned members under `folder` as plain files and folders; returns the file count."""
    base = os.path.realpath(folder) + os.sep
    files = 0
    for member, parts in progress_bar(plan, desc="extract", unit="file", disable=not progress, leave=False):
        target = folder.joinpath(*parts)
        if not os.path.realpath(target).startswith(base):
            raise UserError(f"refusing to extract {archive}: member {member.name!r} would land outside the data "
                            f"folder")
        if member.isdir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        with tar.extractfile(member) as src, open(target, "wb") as dst:  # type: ignore[union-attr]
            shutil.copyfileobj(src, dst, CHUNK_SIZE)
        files += 1
    return files
