"""Seeing and bounding the decoded-data cache (`python -m tools.data cache`): what it holds per kind; removing
all, the least recently used beyond a size, or what no version reads. A folder holding anything the cache does
not write is refused whole (a mistyped --cache-dir removes nothing). See docs/how-it-works.md, Decoding."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import stat
import time
from pathlib import Path

from tools.data import store
from tools.data.store import PACK_NAME, STORE_VERSION, reference_build
from tools.data.temporary import ENTRY_NAMES, REMOVING, entry_temporary, holds_entry_files, is_stale, remove_entry
from tools.errors import UserError, option

log = logging.getLogger(__name__)

# The whole-data entries that versions before the packs wrote at the top (`<digest>-<mask arithmetic>-v<format>/`):
# no version since reads them.
EARLIER_ENTRY = re.compile(r"[0-9a-f]{24}-[a-z]+-v\d+")
EARLIER_KIND = "pre-pack data"
ENTRY_FOLDER = re.compile(r"[a-z]+(?:-[a-z]+)*")  # a folder of `store.CacheEntry`s, e.g. clip-heads
ENTRY_KEY = re.compile(r"[0-9a-f]{16,64}")  # a `store.CacheEntry`'s folder: a digest of its inputs
UNITS = "KMGT"  # size suffixes, powers of 1024 as `du -h` writes them
SIZE = re.compile(r"(?P<number>\d+(\.\d*)?|\.\d+)\s*(?P<unit>[KMGT]?)(i?B)?", re.IGNORECASE)


def parse_size(text: str) -> int:
    """A size in bytes from `20G`, `500M`, `1.5T`, `100K` or a plain number of bytes (K, M, G, T: powers of 1024;
    `GB`, `GiB` read as `G`); ValueError for anything else."""
    match = SIZE.fullmatch(text.strip())
    size = math.nan if match is None else \
        float(match["number"]) * 1024 ** (UNITS.index(match["unit"].upper()) + 1 if match["unit"] else 0)
    if not math.isfinite(size):  # not a size, or more digits than a number holds
        raise ValueError(f"{text!r} is not a size such as 20G, 500M or 1048576 (bytes)")
    return int(size)


def format_size(nbytes: int) -> str:
    """`du -h`'s way: 512B, 1.5K, 6.8G (powers of 1024; `parse_size` reads it back)."""
    size, unit = float(nbytes), "B"
    for candidate in UNITS:
        if size < 1024:
            break
        size, unit = size / 1024, candidate
    return f"{int(size)}B" if unit == "B" else f"{size:.1f}{unit}"


@dataclasses.dataclass(frozen=True)
class Entry:
    """A pack or another cache entry: its folder, kind (`image`, or the folder of another entry: `clip-heads`),
    rows (None: not a pack), bytes, last use (epoch seconds), whether this version reads it, and `unreadable`."""

    path: Path
    kind: str
    rows: int | None
    size: int
    last_used: float
    readable: bool = True
    unreadable: bool = False

    @property
    def is_pack(self) -> bool:
        return self.rows is not None


@dataclasses.dataclass(frozen=True)
class Temporary:
    """A writer's temporary folder; `live`: its process runs, or it is another host's."""

    path: Path
    size: int
    live: bool


@dataclasses.dataclass
class CacheContents:
    """What a cache folder holds (`survey`); `exists`: False where the folder was never made."""

    folder: Path
    entries: list[Entry]
    temporaries: list[Temporary]
    exists: bool = True

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries) + sum(t.size for t in self.temporaries)

    def lines(self) -> list[str]:
        """What `python -m tools.data cache` prints: per kind (another build's or version's and the unreadable apart)
        packs or entries, rows, bytes and day last used; the total; the writers' folders."""
        groups: dict[tuple[int, bool, str], list[Entry]] = {}
        for entry in self.entries:  # packs first, then another build's or version's, unreadable ones last
            state = 2 if entry.unreadable else 0 if entry.readable else 1
            groups.setdefault((state, not entry.is_pack, entry.kind), []).append(entry)
        table = [("kind", "packs/entries", "rows", "size", "last used")]
        for (state, _, kind), entries in sorted(groups.items()):
            rows = sum(e.rows or 0 for e in entries) if entries[0].is_pack else None
            table.append((kind + STATE_LABELS[state], str(len(entries)), _count(rows),
                          format_size(sum(e.size for e in entries)), _day(max(e.last_used for e in entries))))
        rows = sum(e.rows or 0 for e in self.entries)
        table.append(("total", str(len(self.entries)), _count(rows), format_size(self.size),
                      _day(max((e.last_used for e in self.entries), default=None))))
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = [f"decoded-data cache at {self.folder}" + ("" if self.exists else " (not made yet: empty)")]
        lines += ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                  .rstrip() for row in table]
        states = {state for state, _, _ in groups}
        if 2 in states:
            lines += ["* damaged, or of a version before packs: no version reads them; `--unreadable` removes them "
                      "(and `--max-size` first)"]
        if 1 in states:
            lines += [f"** of another format version or decoder build than this one's (v{STORE_VERSION}, "
                      f"{reference_build()}):", "   another install sharing the cache may read them; removed by "
                      "last use like the others"]
        for live in (True, False):
            temporaries = [t for t in self.temporaries if t.live == live]
            if temporaries:
                what = "writer(s) at work, kept" if live else "folder(s) of stopped writers, removed by the next use"
                lines.append(f"{len(temporaries)} {what} ({format_size(sum(t.size for t in temporaries))}, in the "
                             f"total)")
        return lines


STATE_LABELS = ("", " (other build/version**)", " (unreadable*)")  # per `Entry`: read by this version, another, none


def _count(rows: int | None) -> str:
    return "-" if rows is None else f"{rows:,}"


def _day(when: float | None) -> str:
    return "-" if when is None else time.strftime("%Y-%m-%d", time.localtime(when))


def _size(path: Path) -> tuple[int, float]:
    """The bytes of the files under `path` and their newest mtime (symbolic links not followed)."""
    total, newest = 0, 0.0
    for parent, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(parent, name))
            except FileNotFoundError:  # removed meanwhile
                continue
            total, newest = total + st.st_size, max(newest, st.st_mtime)
    return total, newest


def _last_used(path: Path, newest: float) -> float:
    try:
        return (path / "meta.json").stat().st_mtime
    except OSError:
        return newest


def _pack(path: Path, kind: str, version: int) -> Entry:
    size, newest = _size(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        rows = int(meta["count"])
        damaged = meta.get("version") != version or meta.get("kind") != kind  # not as its name says
        readable = not damaged and version == STORE_VERSION and meta.get("reference") == reference_build()
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # damaged: no meta, or not a pack's
        rows, readable, damaged = 0, False, True
    return Entry(path, kind, rows, size, _last_used(path, newest), readable, unreadable=damaged)


def _entry(path: Path, kind: str, unreadable: bool = False) -> Entry:
    size, newest = _size(path)
    return Entry(path, kind, None, size, _last_used(path, newest), not unreadable, unreadable)


def _temporary(path: Path, owner: tuple) -> Temporary:
    """Live unless stale (`temporary.is_stale`) or what a removal of this process could not delete."""
    stale = path.name.startswith(ENTRY_NAMES.owned_by() + REMOVING) or is_stale(path, owner)
    return Temporary(path, _size(path)[0], live=not stale)


def _is_folder(path: Path) -> bool:
    return stat.S_ISDIR(path.lstat().st_mode)  # a link is not one: the cache makes none


def _is_entry(path: Path) -> bool:
    """Whether `path` holds what a pack or an entry holds: its meta.json, and only files the cache writes."""
    return (path / "meta.json").is_file() and holds_entry_files(path)


def survey(cache_dir: Path) -> CacheContents:
    """What `cache_dir` holds (one that does not exist: empty). UserError where it is not a folder, cannot be read,
    or holds what the toolkit does not write there."""
    folder = Path(cache_dir)
    entries, temporaries, foreign = [], [], []
    try:
        if not folder.exists():
            return CacheContents(folder, [], [], exists=False)
        if not folder.is_dir():
            raise UserError(f"{option('--cache-dir', folder)} is not a folder; give the decoded-data cache's folder")
        for path in sorted(folder.iterdir()):
            pack, owner = PACK_NAME.fullmatch(path.name), entry_temporary(path)
            if owner is not None:
                temporaries.append(_temporary(path, owner))
            elif pack is not None and _is_folder(path) and _is_entry(path):
                entries.append(_pack(path, pack["kind"], int(pack["version"])))
            elif EARLIER_ENTRY.fullmatch(path.name) and _is_folder(path) and _is_entry(path):
                entries.append(_entry(path, EARLIER_KIND, unreadable=True))
            elif ENTRY_FOLDER.fullmatch(path.name) and _is_folder(path) and not (path / "meta.json").exists():
                for child in sorted(path.iterdir()):
                    owner = entry_temporary(child)
                    if owner is not None:
                        temporaries.append(_temporary(child, owner))
                    elif ENTRY_KEY.fullmatch(child.name) and _is_folder(child) and _is_entry(child):
                        entries.append(_entry(child, path.name))
                    else:
                        foreign.append(child)
            else:
                foreign.append(path)
    except OSError as exc:
        raise UserError(f"cannot read the cache folder {folder}: {exc}") from None
    if foreign:
        raise UserError(f"{folder} does not look like the decoded-data cache: it holds {foreign[0]}"
                        f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, which the toolkit does not "
                        f"write there; give {option('--cache-dir')} the cache's folder, or remove what is not the "
                        f"cache's")
    return CacheContents(folder, entries, temporaries)


@dataclasses.dataclass
class Removal:
    """What a clean-up removed (entries and stale temporaries), what it could not, and the cache afterwards."""

    removed: list[Entry | Temporary]
    failed: list[tuple[Path, str]]
    after: CacheContents

    def lines(self) -> list[str]:
        packs = sum(1 for e in self.removed if isinstance(e, Entry) and e.is_pack)
        entries = sum(1 for e in self.removed if isinstance(e, Entry) and not e.is_pack)
        stale = len(self.removed) - packs - entries
        lines = [f"removed {packs} pack(s), {entries} other entr{'y' if entries == 1 else 'ies'} and {stale} "
                 f"stopped writer folder(s): {format_size(sum(e.size for e in self.removed))}"]
        lines += [f"could not remove {path}: {reason}" for path, reason in self.failed]
        return [*lines, *self.after.lines()]


def _remove(contents: CacheContents, chosen: list[Entry]) -> Removal:
    removed: list[Entry | Temporary] = []
    failed: list[tuple[Path, str]] = []
    for item in [*(t for t in contents.temporaries if not t.live), *chosen]:
        try:
            remove_entry(item.path)
        except OSError as exc:
            failed.append((item.path, exc.strerror or str(exc)))
            log.warning("could not remove %s (%s)", item.path, exc)
        else:
            removed.append(item)
    return Removal(removed, failed, survey(contents.folder))


def clear(cache_dir: Path) -> Removal:
    """Remove every pack and entry (and the folders of stopped writers); the folder and running writers' stay."""
    contents = survey(cache_dir)
    return _remove(contents, contents.entries)


def remove_unreadable(cache_dir: Path) -> Removal:
    """Remove what no version reads and stopped writers' folders; another version's or build's packs stay."""
    contents = survey(cache_dir)
    return _remove(contents, [e for e in contents.entries if e.unreadable])


def eviction_order(entries: list[Entry]) -> list[Entry]:
    """`trim`'s order: what no version reads, then least recently used; ties by path."""
    return sorted(entries, key=lambda e: (not e.unreadable, e.last_used, str(e.path)))


def trim(cache_dir: Path, max_size: int) -> Removal:
    """Remove entries in `eviction_order` (and stopped writers' folders) until the cache, running writers' folders
    counted, takes at most `max_size` bytes."""
    contents = survey(cache_dir)
    total = contents.size - sum(t.size for t in contents.temporaries if not t.live)
    chosen = []
    for entry in eviction_order(contents.entries):
        if total <= max_size:
            break
        chosen.append(entry)
        total -= entry.size
    removal = _remove(contents, chosen)
    if removal.after.size > max_size:
        log.warning("the cache still takes %s, over %s: what is left is running writers' (or could not be removed)",
                    format_size(removal.after.size), format_size(max_size))
    return removal


def written_line() -> str | None:
    """The one line a command says about what it wrote into the cache (`store.take_written`); None for nothing."""
    written = store.take_written()
    if not written:
        return None
    kinds: dict[str, list[str]] = {}
    for (what, folder), size in written.items():
        kinds.setdefault(what, []).append(f"{format_size(size)} in {folder}")
    places = "; ".join(f"{what} cached: {', '.join(sizes)}" for what, sizes in kinds.items())
    return (f"{places} (`python -m tools.data cache` lists the cache, `--max-size` bounds it; {option('--no-cache')} "
            f"skips it)")
