"""The Hugging Face Hub cache as the `timm:` and `hf:` sources read it: where it is, which cached file a repository's
weights are, and the one line for when they are not there.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath


def cache_folder() -> Path:
    """The hub cache huggingface_hub reads (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants  # noqa: PLC0415 (installed with timm and transformers, both optional)
    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants  # noqa: PLC0415
    return bool(constants.HF_HUB_OFFLINE)


def split_revision(repo: str) -> tuple[str, str | None]:
    """`ORG/NAME@REVISION` -> (ORG/NAME, REVISION or None)."""
    repo_id, _, revision = repo.partition("@")
    return repo_id, revision or None


def cached_file(repo: str, filenames: list[str]) -> Path | None:
    """The first of `filenames` in the cache's snapshot of `repo` (`ORG/NAME[@REVISION]`), else None."""
    from huggingface_hub import try_to_load_from_cache  # noqa: PLC0415
    repo_id, revision = split_revision(repo)
    for filename in filenames:
        found = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(found, str):  # not None, nor the marker of a file known to be missing
            return Path(found)
    return None


def snapshot_revision(path: Path) -> str | None:
    """The commit a file in the cache was downloaded at (its snapshot folder's name); None outside the cache."""
    parts = Path(path).parts
    repos = [i for i, part in enumerate(parts[:-3]) if part.startswith(("models--", "datasets--"))]
    if repos and parts[repos[-1] + 1] == "snapshots":  # .../models--ORG--NAME/snapshots/REV/FILE
        return parts[repos[-1] + 2]
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else None


def in_cache(path: Path) -> bool:
    """Whether `path` is a hub cache's file, whose content depends on where refs/ point now."""
    parts = Path(path).parts
    return snapshot_revision(path) is not None or (
        len(parts) >= 3 and parts[-2] == "blobs" and parts[-3].startswith(("models--", "datasets--")))


def inside_folder(name: str) -> bool:
    """Whether a relative name a model's JSON gives stays inside its folder (not absolute, no `..`, no drive)."""
    path = PurePosixPath(name.replace("\\", "/"))
    return bool(name) and not path.is_absolute() and ".." not in path.parts and ":" not in name


def files_root(folder: Path) -> Path:
    """The folder a model's files may resolve into through links: the repository's folder for a hub snapshot or a folder
    in it, however named; else the folder itself."""
    folder = folder.resolve()
    for inside in (folder, *folder.parents):
        if inside.parent.name == "snapshots" and (inside.parent.parent / "blobs").is_dir():
            return inside.parent.parent
    return folder


def snapshot_command(repo: str) -> str:
    """The command that fetches a repository (`ORG/NAME[@REVISION]`) into the cache."""
    repo_id, revision = split_revision(repo)
    at = f", revision='{revision}'" if revision else ""
    return f"python -c \"from huggingface_hub import snapshot_download; snapshot_download('{repo_id}'{at})\""


def not_cached_line(what: str, fetch: str, reason: str) -> str:
    """The one line for weights that are neither in the cache nor downloadable now."""
    state = "offline (HF_HUB_OFFLINE)" if offline() else reason
    return (f"cannot load {what}: not in the Hugging Face cache {cache_folder()} and not downloadable ({state}); "
            f"fetch them with the network on (same HF_HOME) with `{fetch}`")
