"""Verified downloads: https only, a published checksum for every file, tar archives extracted with a
filter that refuses any member that would land outside the target folder.

One attempt per file and no retries, so an offline machine fails at once with one sentence (the data
set's own message, see :mod:`fl_lightning.data.sources`) instead of a page of retry noise.

Hugging Face Hub data sets go through ``huggingface_hub`` (its endpoint, ``HF_ENDPOINT``, its token and offline
mode): the revision is resolved to a commit first (one request: offline, a fetch fails there), the files are
listed and downloaded at that commit, and each is checked here against the hash the listing gave before it is
moved into place. huggingface_hub retries a listing or a download that fails midway, as it does for everyone.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ..federation.errors import ConfigError
from ..federation.files import lock_file

if TYPE_CHECKING:
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

T = TypeVar("T")

log = logging.getLogger(__name__)

CHUNK = 1 << 20


class NetworkError(ConfigError):
    """The server could not be reached (no network, DNS, proxy, HTTP error); ``reason`` is one short line."""

    def __init__(self, url: str, err: BaseException):
        self.url = url
        self.reason = _short(err)
        super().__init__(f"downloading {url} failed ({self.reason}); check the connection or proxy and run again.")


def _short(err: BaseException) -> str:
    """One line naming the failure, e.g. ``URLError: [Errno -2] Name or service not known``."""
    detail = getattr(err, "reason", None) or err
    text = " ".join(str(detail).split())[:160]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _open(url: str, timeout: float = 60.0):
    """Opens ``url`` (tests replace this to simulate no network or a corrupt server)."""
    request = urllib.request.Request(url, headers={"User-Agent": "fl-lightning"})
    return urllib.request.urlopen(request, timeout=timeout)


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a file's bytes: the Hugging Face Hub names its small (non-LFS) files by it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of a file (``sha256``, ``md5`` or ``git-sha1``)."""
    if algorithm == "git-sha1":
        return git_blob_sha1(path.read_bytes())
    digest = hashlib.new(algorithm)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _checksum(sha256: str | None, md5: str | None, git_sha1: str | None) -> tuple[str, str]:
    for algorithm, value in (("sha256", sha256), ("md5", md5), ("git-sha1", git_sha1)):
        if value:
            return algorithm, value.lower()
    raise ConfigError("refusing to download a file without a published checksum (sha256, md5 or git-sha1).")


def download(
    url: str, path: Path, *, sha256: str | None = None, md5: str | None = None, git_sha1: str | None = None
) -> Path:
    """Downloads ``url`` to ``path`` and checks its checksum; a file already there that matches is kept.

    The bytes go to ``<path>.part`` first and are renamed only after the checksum matched, so a broken or
    altered download never sits where a loader would read it.

    Raises:
        NetworkError: the server could not be reached.
        ConfigError: not https, no checksum given, or the downloaded bytes do not match the checksum.
    """
    algorithm, expected = _checksum(sha256, md5, git_sha1)
    if not url.startswith("https://"):
        raise ConfigError(f"refusing to download {url}: only https URLs are fetched.")
    path = Path(path)
    if path.is_file() and file_digest(path, algorithm) == expected:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # runs started together (flrun table / sweep --n_jobs) fetch a file once: the others wait, then find it
    with lock_file(path.with_name(path.name + ".lock")):
        if path.is_file() and file_digest(path, algorithm) == expected:
            return path
        return _fetch(url, path, algorithm, expected)


def _fetch(url: str, path: Path, algorithm: str, expected: str) -> Path:
    part = path.with_name(path.name + ".part")
    try:
        with part.open("wb") as out:
            _download_into(out, url, path)
    except OSError as err:  # this machine's disk (full, read-only): the network's errors are NetworkErrors by now
        part.unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror, str(path)) from None
    except ConfigError:
        part.unlink(missing_ok=True)
        raise
    _accept(part, path, url, algorithm, expected)
    return path


def _accept(part: Path, path: Path, url: str, algorithm: str, expected: str) -> None:
    """Renames the downloaded ``part`` to ``path`` if its checksum matches, else deletes it and says so."""
    actual = file_digest(part, algorithm)
    if actual != expected:
        part.unlink()
        raise ConfigError(
            f"{path.name} from {url} failed its {algorithm} check (got {actual}, expected {expected}); the "
            "download is corrupt or not the published file, so it was deleted: run the fetch again."
        )
    part.replace(path)


def _download_into(out, url: str, path: Path) -> None:
    """Copies ``url`` into the open file ``out``; the server's failures raise NetworkError, the disk's OSError."""
    try:
        response = _open(url)
    except OSError as err:  # URLError, HTTPError, timeouts and resets are all OSErrors
        raise NetworkError(url, err) from None
    with response:
        final = response.geturl() if hasattr(response, "geturl") else url
        if not str(final).startswith("https://"):
            raise ConfigError(f"refusing {url}: the server redirected to a non-https address ({final}).")
        log.info("downloading %s -> %s", url, path)  # only once it is reachable
        while True:
            try:
                chunk = response.read(CHUNK)
            except OSError as err:
                raise NetworkError(url, err) from None
            if not chunk:
                return
            out.write(chunk)


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_member(member: tarfile.TarInfo, root: Path) -> str | None:
    """Why ``member`` may not be extracted into ``root`` (already resolved), or None when it is safe."""
    name = member.name
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return "an absolute path"
    target = (root / name).resolve()
    if not _inside(target, root):
        return "a path that leaves the folder"
    if member.issym():
        if member.linkname.startswith(("/", "\\")):
            return f"a symbolic link to the absolute path {member.linkname!r}"
        if not _inside((target.parent / member.linkname).resolve(), root):
            return f"a symbolic link to {member.linkname!r}, outside the folder"
    if member.islnk() and not _inside((root / member.linkname).resolve(), root):
        return f"a hard link to {member.linkname!r}, outside the folder"
    if member.isdev():
        return "a device or pipe"
    return None


def safe_extract(archive: Path, dest: Path) -> None:
    """Extracts a tar archive (any compression) into ``dest``, refusing every member that would be written
    outside it: absolute paths, ``..``, links pointing out, devices. Nothing is extracted if one is refused.
    """
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    root = dest.resolve()
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for member in members:
                why = check_member(member, root)
                if why is not None:
                    raise ConfigError(
                        f"refusing to extract {Path(archive).name}: member {member.name!r} is {why}, which "
                        f"could write outside {dest}; nothing was extracted (delete the archive, it is not "
                        "the published one)."
                    )
            # Python's own "data" filter (3.11.4+, 3.12+) checks the same again against the disk as it writes
            if hasattr(tarfile, "data_filter"):
                tar.extractall(root, members=members, filter="data")
            else:
                tar.extractall(root, members=members)
    except tarfile.TarError as err:
        raise ConfigError(f"{archive} is not a readable tar archive ({err}); delete it and fetch again.") from None


def hub_commit(repo_id: str, revision: str) -> str:
    """The commit id a Hub data set's ``revision`` (a branch, tag or commit) names now, through
    ``huggingface_hub``; the first request of a Hub fetch, so an offline machine fails here, at once."""
    api = _hub_api()
    url = f"{api.endpoint}/api/datasets/{repo_id}/revision/{urllib.parse.quote(revision, safe='')}"
    commit = _hub_call(url, lambda: api.dataset_info(repo_id, revision=revision).sha, repo_id, revision)
    if not commit:
        raise ConfigError(f"{url} named no commit for {repo_id} at {revision}; try again later.")
    return commit


def hub_files(repo_id: str, commit: str, folder: str = "") -> list[RepoFile]:
    """A Hub data set's files under ``folder`` at ``commit`` with their checksums (``lfs.sha256`` for large
    files, ``blob_id``, the git object id, for small ones), from the Hub's paged tree listing."""
    from huggingface_hub.hf_api import RepoFile

    api = _hub_api()
    where = f"/{urllib.parse.quote(folder)}" if folder else ""
    url = f"{api.endpoint}/api/datasets/{repo_id}/tree/{commit}{where}?recursive=true"

    def listing() -> list[RepoFile]:  # huggingface_hub follows the pages (Link: rel="next") as it is read
        tree = api.list_repo_tree(repo_id, folder or None, recursive=True, revision=commit, repo_type="dataset")
        return [entry for entry in tree if isinstance(entry, RepoFile)]

    return _hub_call(url, listing, repo_id, commit)


def hub_download(repo_id: str, commit: str, entry: RepoFile, path: Path) -> Path:
    """Downloads one file of :func:`hub_files` at ``commit`` to ``path``, checked against the hash the listing
    gave (not huggingface_hub's), so that only the listed bytes reach ``path``; a file there that matches is kept.

    ``huggingface_hub`` writes into ``<path>.part/`` (its own folder, with its metadata); the file is renamed
    to ``path`` only after the checksum matched, and the folder is removed whatever happened.
    """
    from huggingface_hub import hf_hub_url

    algorithm, expected = ("sha256", entry.lfs.sha256) if entry.lfs else ("git-sha1", entry.blob_id)
    path = Path(path)
    if path.is_file() and file_digest(path, algorithm) == expected:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    api = _hub_api()
    url = hf_hub_url(repo_id, entry.path, repo_type="dataset", revision=commit, endpoint=api.endpoint)
    part = path.with_name(path.name + ".part")

    def fetched() -> str:
        return str(api.hf_hub_download(repo_id, entry.path, repo_type="dataset", revision=commit, local_dir=part))

    with lock_file(path.with_name(path.name + ".lock")):
        if path.is_file() and file_digest(path, algorithm) == expected:
            return path
        try:
            got = Path(_hub_call(url, fetched, repo_id, commit))
            log.info("downloaded %s -> %s", url, path)
            _accept(got, path, url, algorithm, expected)
        finally:
            shutil.rmtree(part, ignore_errors=True)
    return path


def _hub_api() -> HfApi:
    """A client of the Hub at huggingface_hub's endpoint (``HF_ENDPOINT``, read when huggingface_hub is imported)."""
    from huggingface_hub import HfApi

    return HfApi()


def _hub_call(url: str, call: Callable[[], T], repo_id: str, revision: str) -> T:
    """``call()``, with huggingface_hub's failures as this module's: the Hub unreachable, offline mode or an
    HTTP error as a NetworkError (the same sentence as any download's), an unknown revision as a ConfigError;
    the disk's errors stay OSErrors."""
    import httpx2
    from huggingface_hub.errors import (
        FileMetadataError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RevisionNotFoundError,
    )

    try:
        return call()
    except RevisionNotFoundError:
        raise ConfigError(
            f"the Hugging Face data set {repo_id} has no revision {revision!r}; give one of its branches, tags or "
            "commit ids."
        ) from None
    except OfflineModeIsEnabled:
        raise NetworkError(url, OfflineModeIsEnabled("HF_HUB_OFFLINE is set")) from None
    except LocalEntryNotFoundError as err:  # hf_hub_download's "cannot reach the Hub": the reason is its cause
        cause = err.__cause__ if isinstance(err.__cause__, Exception) else err
        if isinstance(cause, OfflineModeIsEnabled):
            cause = OfflineModeIsEnabled("HF_HUB_OFFLINE is set")
        raise NetworkError(url, cause) from None
    except (httpx2.HTTPError, HfHubHTTPError, FileMetadataError) as err:
        raise NetworkError(url, err) from None
    except OSError as err:
        if err.errno is None:  # huggingface_hub's "Consistency check failed": a download cut short
            raise NetworkError(url, err) from None
        raise
