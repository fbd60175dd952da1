"""`python -m tools.data fetch`: download from a local HTTP server, resume, hash check, safe extraction, offline."""

from __future__ import annotations

import hashlib
import http.server
import io
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

from tests.helpers import run_in_process, signal_when_ready
from tools.data import cli as data_cli
from tools.data import download, synthetic
from tools.data import download as data_download
from tools.data.hashing import sha256_file
from tools.data.layout import list_foregrounds, list_variation
from tools.errors import UserError
from tools.in9 import MASK_FOLDER, VARIATIONS

ARCHIVE_PATH = "/release/" + download.ARCHIVE_NAME


def _tar_gz(add_members) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        add_members(tar)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(archive bytes, sha256): a generated dataset tarred under a bg_challenge/ top folder, like the release."""
    source = tmp_path_factory.mktemp("release") / "bg_challenge"
    synthetic.generate(source, per_class=1, seed=3)
    payload = _tar_gz(lambda tar: tar.add(source, arcname="bg_challenge"))
    return payload, hashlib.sha256(payload).hexdigest()


class _Handler(http.server.BaseHTTPRequestHandler):
    """Serves the server's `files`; honours `Range: bytes=N-` unless the server says not to."""

    def do_GET(self):
        server = self.server
        requested_range = self.headers.get("Range")
        server.requests.append((self.path, requested_range))
        body = server.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = 0
        if requested_range and server.honour_range:
            start = int(re.fullmatch(r"bytes=(\d+)-", requested_range).group(1))
            if start >= len(body):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(body)}")
                self.end_headers()
                return
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        payload = body[start:]
        if server.cut_after is not None:  # announce everything, send a part, hang up
            payload = payload[:server.cut_after]
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """A threaded HTTP server on 127.0.0.1 (a free port), stopped at the end of the test."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.files, httpd.requests, httpd.honour_range, httpd.cut_after = {}, [], True, None
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    httpd.url = lambda path: f"http://127.0.0.1:{httpd.server_address[1]}{path}"
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


def _run_cli(argv, capsys):
    return run_in_process(data_cli.main, argv, capsys)


def _assert_release_layout(root: Path, per_class: int = 1):
    for name in VARIATIONS:
        records = list_variation(root, name)
        assert len(records) == 9 * per_class
        assert sorted({r.label for r in records}) == list(range(9))
    assert len(list_foregrounds(root)) == 9 * per_class
    assert not (root / "bg_challenge").exists()


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_download_checks_hash_and_extracts_the_layout(server, release, tmp_path):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    result = download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)
    _assert_release_layout(root)
    assert result.verified and result.sha256 == sha
    assert result.downloaded_bytes == len(payload) and not result.resumed
    assert result.counts == {**{name: 9 for name in VARIATIONS}, MASK_FOLDER: 9}
    assert result.files == 9 * 8 + 9 + 1  # images, masks and the generator's manifest
    assert _leftovers(root) == sorted([*VARIATIONS, MASK_FOLDER, synthetic.MANIFEST_NAME])  # archive deleted
    assert server.requests == [(ARCHIVE_PATH, None)]


def test_cli_keeps_the_archive_when_asked(server, release, tmp_path, capsys):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    code, out, err = _run_cli(["fetch", "--data-path", str(root), "--url", server.url(ARCHIVE_PATH), "--sha256", sha,
                               "--keep-archive", "--no-progress"], capsys)
    assert code == 0, err
    assert f"sha256: {sha} verified" in out and "archive kept at" in out
    assert sha256_file(root / download.ARCHIVE_NAME) == sha
    _assert_release_layout(root)
    # a second run finds the data in place and downloads nothing
    code, out, _ = _run_cli(["fetch", "--data-path", str(root), "--url", server.url(ARCHIVE_PATH), "--no-progress"],
                            capsys)
    assert code == 0 and "nothing fetched" in out and len(server.requests) == 1


def test_resumes_a_partial_download_with_a_range_request(server, release, tmp_path):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    root.mkdir()
    half = len(payload) // 2
    (root / (download.ARCHIVE_NAME + download.PART_SUFFIX)).write_bytes(payload[:half])
    result = download.fetch(root, server.url(ARCHIVE_PATH), sha, keep_archive=True, progress=False)
    assert server.requests == [(ARCHIVE_PATH, f"bytes={half}-")]
    assert result.resumed and result.downloaded_bytes == len(payload) - half
    assert sha256_file(root / download.ARCHIVE_NAME) == sha
    _assert_release_layout(root)


def test_a_part_that_is_already_whole_is_not_downloaded_again(server, release, tmp_path):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    root.mkdir()
    (root / (download.ARCHIVE_NAME + download.PART_SUFFIX)).write_bytes(payload)
    result = download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)  # the server answers 416
    assert server.requests == [(ARCHIVE_PATH, f"bytes={len(payload)}-")]
    assert result.downloaded_bytes == 0 and result.verified
    _assert_release_layout(root)


def test_restarts_when_the_server_ignores_range(server, release, tmp_path, caplog):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    server.honour_range = False
    root = tmp_path / "data"
    root.mkdir()
    (root / (download.ARCHIVE_NAME + download.PART_SUFFIX)).write_bytes(payload[:1000])
    with caplog.at_level(logging.WARNING, logger="tools.data"):
        result = download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)
    assert server.requests == [(ARCHIVE_PATH, "bytes=1000-")]
    assert "ignored the request to resume" in caplog.text
    assert not result.resumed and result.downloaded_bytes == len(payload) and result.sha256 == sha
    _assert_release_layout(root)


def test_a_dropped_connection_keeps_the_part_for_the_next_run(server, release, tmp_path):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    server.cut_after = 5000
    root = tmp_path / "data"
    with pytest.raises(UserError, match=r"stopped after 5,000 of [\d,]+ bytes .*rerun the same command to resume"):
        download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)
    part = root / (download.ARCHIVE_NAME + download.PART_SUFFIX)
    assert part.read_bytes() == payload[:5000]
    server.cut_after = None
    result = download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)
    assert server.requests[-1] == (ARCHIVE_PATH, "bytes=5000-") and result.resumed
    _assert_release_layout(root)


def test_sha256_mismatch_is_one_error_and_the_file_is_moved_aside(server, release, tmp_path, capsys):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    code, out, err = _run_cli(["fetch", "--data-path", str(root), "--url", server.url(ARCHIVE_PATH),
                               "--sha256", "0" * 64, "--no-progress"], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: SHA-256 mismatch") and "Traceback" not in err
    assert f"got {sha}, expected {'0' * 64}" in err and "moved aside" in err
    bad = root / (download.ARCHIVE_NAME + download.BAD_SUFFIX)
    assert str(bad) in err and bad.read_bytes() == payload
    assert _leftovers(root) == [bad.name]  # no .part, no archive, nothing extracted


def test_a_url_without_sha256_is_not_checked_but_reported(server, release, tmp_path, caplog):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    with caplog.at_level(logging.WARNING, logger="tools.data"):
        result = download.fetch(tmp_path / "data", server.url(ARCHIVE_PATH), progress=False)
    assert not result.verified and result.sha256 == sha
    assert "not checking the SHA-256" in caplog.text and sha in caplog.text
    assert "NOT verified" in "\n".join(result.lines())


def test_the_release_url_is_checked_against_the_release_hash():
    assert download.RELEASE_URL.endswith("/" + download.ARCHIVE_NAME)
    assert download.RELEASE_SIZE == 279_581_133
    assert re.fullmatch(r"[0-9a-f]{64}", download.RELEASE_SHA256)


def test_an_already_downloaded_archive_is_extracted(release, tmp_path):
    payload, sha = release
    archive = tmp_path / "download" / "anything.tar.gz"
    archive.parent.mkdir()
    archive.write_bytes(payload)
    with pytest.raises(UserError, match="SHA-256 mismatch .*left in place"):  # checked against the release's hash
        download.fetch(tmp_path / "data", archive=archive, progress=False)
    assert archive.exists()
    result = download.fetch(tmp_path / "data", archive=archive, sha256=sha, progress=False)
    assert result.verified and archive.read_bytes() == payload  # the user's file is left alone
    _assert_release_layout(tmp_path / "data")


def test_an_archive_placed_where_fetch_would_download_it_is_used(server, release, tmp_path):
    payload, sha = release
    root = tmp_path / "data"
    root.mkdir()
    (root / download.ARCHIVE_NAME).write_bytes(payload)
    result = download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)  # the server has no such file
    assert server.requests == [] and result.downloaded_bytes == 0
    _assert_release_layout(root)


def test_offline_is_one_line_saying_what_to_download_and_where(tmp_path, capsys):
    with socket.socket() as sock:  # a port that was free a moment ago and now has no listener
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/release/{download.ARCHIVE_NAME}"
    root = tmp_path / "data"
    code, out, err = _run_cli(["fetch", "--data-path", str(root), "--url", url, "--sha256", "a" * 64, "--no-progress",
                               "--timeout", "5"], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: cannot download {url}")
    assert str(root / download.ARCHIVE_NAME) in err and download.PART_SUFFIX in err
    assert "verifies and extracts" in err and "--archive" in err


def test_a_failed_fetch_leaves_no_empty_folder(server, release, tmp_path, capsys):
    """Offline, a missing URL or a missing --archive: the folders fetch created for the data are gone again (an
    empty data/ in a clone would look like data); a folder that was there stays, and so does one that keeps a
    partial download to resume from."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        offline = f"http://127.0.0.1:{sock.getsockname()[1]}/release/{download.ARCHIVE_NAME}"
    existing = tmp_path / "existing"
    existing.mkdir()
    for root in (tmp_path / "data" / "bg_challenge", existing / "in9"):
        for flags in (["--url", offline, "--timeout", "5"], ["--url", server.url("/missing.tar.gz")],
                      ["--archive", str(tmp_path / "nowhere.tar.gz")]):
            code, _, err = _run_cli(["fetch", "--data-path", str(root), "--sha256", "a" * 64, "--no-progress", *flags],
                                    capsys)
            assert code == 2 and err.startswith("error: "), err
            assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"], flags
            assert existing.is_dir() and list(existing.iterdir()) == []
    payload, sha = release
    server.files[ARCHIVE_PATH], server.cut_after = payload, 5000
    root = tmp_path / "data" / "bg_challenge"
    with pytest.raises(UserError, match="rerun the same command to resume"):
        download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)
    assert _leftovers(root) == [download.ARCHIVE_NAME + download.PART_SUFFIX]


def test_http_errors_are_user_errors(server, tmp_path):
    with pytest.raises(UserError, match="HTTP 404"):
        download.fetch(tmp_path / "data", server.url("/missing.tar.gz"), "a" * 64, progress=False)


def _evil_members(kind: str, outside: Path):
    def add(tar: tarfile.TarFile):
        def file(name: str, content: bytes = b"evil"):
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))

        file("bg_challenge/original/val/00_dog/fine.JPEG", b"fine")
        if kind == "dotdot":
            file("bg_challenge/../../outside/evil.txt")
        elif kind == "absolute":
            file(str(outside / "evil.txt"))
        elif kind in ("symlink", "hardlink"):
            link = tarfile.TarInfo("bg_challenge/original/val/link")
            link.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
            link.linkname = str(outside)
            tar.addfile(link)
            file("bg_challenge/original/val/link/evil.txt")
        elif kind == "device":
            device = tarfile.TarInfo("bg_challenge/original/val/tty")
            device.type = tarfile.CHRTYPE
            tar.addfile(device)
    return add


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "hardlink", "device"])
def test_an_unsafe_archive_is_refused_and_nothing_is_written(server, tmp_path, kind):
    outside = tmp_path / "outside"
    payload = _tar_gz(_evil_members(kind, outside))
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    with pytest.raises(UserError, match=r"refusing to extract .*unsafe member.*nothing was extracted"):
        download.fetch(root, server.url(ARCHIVE_PATH), hashlib.sha256(payload).hexdigest(), progress=False)
    assert not outside.exists()
    assert _leftovers(root) == [download.ARCHIVE_NAME]  # only the verified download: no folders, no temporary files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]


def test_an_archive_that_is_not_a_tar_is_a_user_error_that_never_advises_deleting_the_users_file(
        server, tmp_path, capsys):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not an archive at all")
    sha = hashlib.sha256(junk.read_bytes()).hexdigest()
    code, _, err = _run_cli(["fetch", "--data-path", str(tmp_path / "data"), "--archive", str(junk), "--sha256", sha,
                             "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert f"cannot read --archive {junk}" in err and "not a tar archive" in err and "delete" not in err
    assert junk.read_bytes() == b"not an archive at all"
    server.files[ARCHIVE_PATH] = junk.read_bytes()  # fetch's own download may be deleted and downloaded again
    code, _, err = _run_cli(["fetch", "--data-path", str(tmp_path / "data"), "--url", server.url(ARCHIVE_PATH),
                             "--sha256", sha, "--no-progress"], capsys)
    assert code == 2 and "not a tar archive" in err and "delete it and rerun fetch" in err


def test_a_folder_with_part_of_a_dataset_is_refused(tmp_path):
    root = tmp_path / "data"
    (root / "original").mkdir(parents=True)
    with pytest.raises(UserError, match=r"already holds part of a dataset \(original\)"):
        download.fetch(root, progress=False)


# ----------------------------------------------------------------------------------------------------------
# Nothing rejected looks fetched; what an interruption leaves

@pytest.fixture(scope="module")
def release_without_a_class(tmp_path_factory):
    """(archive bytes, sha256): the release with mixed_next/val/08_fish missing."""
    source = tmp_path_factory.mktemp("broken") / "bg_challenge"
    synthetic.generate(source, per_class=1, seed=3)
    shutil.rmtree(source / "mixed_next" / "val" / "08_fish")
    payload = _tar_gz(lambda tar: tar.add(source, arcname="bg_challenge"))
    return payload, hashlib.sha256(payload).hexdigest()


def test_a_release_that_fails_the_check_is_not_fetched_and_its_archive_is_kept(server, release_without_a_class,
                                                                              tmp_path, capsys):
    payload, sha = release_without_a_class
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    argv = ["fetch", "--data-path", str(root), "--url", server.url(ARCHIVE_PATH), "--sha256", sha, "--no-progress"]
    errors = []
    for _ in range(2):  # the same check, and the same answer, both times
        code, out, err = _run_cli(argv, capsys)
        error = err.splitlines()[-1]
        assert code == 2 and out == "" and error.startswith("error: ") and err.count("error:") == 1, err
        assert "mixed_next/val" in error and "08_fish" in error and "not a usable release" in error
        assert _leftovers(root) == [download.ARCHIVE_NAME]  # nothing extracted, the archive kept for the next try
        errors.append(error)
    assert errors[0] == errors[1] and len(server.requests) == 1  # downloaded once


def test_a_folder_holding_every_variation_is_checked_before_it_is_called_fetched(release, tmp_path, capsys):
    payload, sha = release
    archive = tmp_path / "release.tar.gz"
    archive.write_bytes(payload)
    root = tmp_path / "data"
    download.fetch(root, archive=archive, sha256=sha, progress=False)
    code, out, _ = _run_cli(["fetch", "--data-path", str(root), "--no-progress"], capsys)
    assert code == 0 and "nothing fetched" in out
    shutil.rmtree(root / "only_fg" / "val" / "03_reptile")
    code, out, err = _run_cli(["fetch", "--data-path", str(root), "--no-progress"], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "only_fg/val" in err and "03_reptile" in err and "not a usable release" in err


# Runs `python -m tools.data fetch ARGS...` in a process of its own whose extraction stops after its third file
# (the main thread sleeps there, where a signal interrupts it).
INTERRUPTIBLE_FETCH = """
import shutil, sys, time
from pathlib import Path
from tools.data import cli

ready, copy, copies = Path(sys.argv[1]), shutil.copyfileobj, []

def copyfileobj(*args, **kwargs):
    copy(*args, **kwargs)
    copies.append(1)
    if len(copies) == 3:
        ready.touch()
        time.sleep(60)

shutil.copyfileobj = copyfileobj
sys.exit(cli.main(["fetch", *sys.argv[2:]]))
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
@pytest.mark.slow
def test_an_interrupted_extraction_leaves_the_archive_and_nothing_else(server, release, tmp_path, signum, code):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    finished = signal_when_ready(INTERRUPTIBLE_FETCH, tmp_path / "ready", ["--data-path", str(root), "--url",
                                 server.url(ARCHIVE_PATH), "--sha256", sha, "--no-progress"], signum)
    stderr = finished.stderr
    assert finished.returncode == code, stderr
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert _leftovers(root) == [download.ARCHIVE_NAME]  # no hidden .extract-* folder; the download is kept
    result = download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)
    assert result.downloaded_bytes == 0 and len(server.requests) == 1  # the next run extracts it
    _assert_release_layout(root)


def test_a_fetch_removes_the_extraction_folders_of_fetches_that_died(server, release, tmp_path):
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    root = tmp_path / "data"
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    stale = root / f".extract-{socket.gethostname()}-{dead}-0a1b2c3d"  # a fetch SIGKILLed while extracting
    running = root / f".extract-{socket.gethostname()}-{os.getpid()}-0a1b2c3d"
    for folder in (stale, running):
        (folder / "original" / "val").mkdir(parents=True)
    download.fetch(root, server.url(ARCHIVE_PATH), sha, progress=False)
    _assert_release_layout(root)
    assert not stale.exists() and running.exists()


@pytest.mark.parametrize("timeout", ["0", "-5", "nan", "inf", "soon"])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused_before_anything_runs(tmp_path, timeout,
                                                                                            capsys):
    root = tmp_path / "data"
    with pytest.raises(SystemExit) as exc:  # argparse's refusal: one error line
        data_cli.main(["fetch", "--data-path", str(root), "--url", "http://127.0.0.1:9/x.tar.gz", "--timeout",
                       timeout, "--no-progress"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"error: argument --timeout: {timeout!r} is not a positive, finite number of seconds; see ")
    assert len(err.splitlines()) == 1, err
    assert not root.exists()


def test_an_archive_that_cannot_be_read_is_one_line_that_leaves_it_alone(release, tmp_path, monkeypatch, capsys):
    payload, sha = release
    archive = tmp_path / "release.tar.gz"
    archive.write_bytes(payload)

    def unreadable(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(data_download, "sha256_file", unreadable)  # root reads every file: the refusal is injected
    code, _, err = _run_cli(["fetch", "--data-path", str(tmp_path / "data"), "--archive", str(archive),
                             "--sha256", sha, "--no-progress"], capsys)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: cannot read --archive {archive}: Permission denied") and "delete" not in err
    assert archive.read_bytes() == payload


@pytest.mark.parametrize("target", ["a file of the user's", "a file of the user's, as long as the archive", "/dev/zero",
                                    "nothing"])
def test_a_link_where_the_partial_download_goes_is_never_written_through(target, server, release, tmp_path, capsys):
    """<data>/<archive>.part a link (to a file of the user's, shorter than the archive or as long, to a device, to
    nothing): fetch writes nothing through it, and says what to do in one line."""
    payload, sha = release
    server.files[ARCHIVE_PATH] = payload
    root, precious = tmp_path / "data", tmp_path / "precious.txt"
    root.mkdir()
    precious.write_bytes(b"x" * (len(payload) if "as long" in target else 10))
    before = precious.read_bytes()
    part = root / (download.ARCHIVE_NAME + download.PART_SUFFIX)
    part.symlink_to(precious if target.startswith("a file") else target if target.startswith("/") else tmp_path / "x")
    code, out, err = _run_cli(["fetch", "--data-path", str(root), "--url", server.url(ARCHIVE_PATH), "--sha256", sha,
                               "--no-progress"], capsys)
    assert code == 2 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and str(part) in line and "remove it" in line
    assert precious.read_bytes() == before and part.is_symlink() and not (tmp_path / "x").exists()
    assert server.requests == []  # nothing downloaded either


def test_files_written_in_place_are_never_written_through_a_link(tmp_path):
    """What the toolkit writes in place rather than whole (fetch's partial download, train.py's train_log.jsonl)
    is opened by `open_own`: a link there is refused, appending or not, and its target left as it was."""
    from tools.provenance import open_own  # noqa: PLC0415
    precious = tmp_path / "precious.txt"
    precious.write_text("mine\n")
    link = tmp_path / "train_log.jsonl"
    link.symlink_to(precious)
    for append in (True, False):
        with pytest.raises(OSError):
            open_own(link, append)
    assert precious.read_text() == "mine\n"
    with open_own(tmp_path / "new.jsonl", append=True) as fh:
        fh.write(b"a\n")
    with open_own(tmp_path / "new.jsonl", append=True) as fh:
        fh.write(b"b\n")
    assert (tmp_path / "new.jsonl").read_bytes() == b"a\nb\n"
