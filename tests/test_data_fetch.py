"""Downloads are https-only and checksummed, archives cannot write outside data_dir, and every data set
with no files and no network fails in one sentence naming the expected files and `flrun data fetch`."""

import dataclasses
import hashlib
import io
import os
import pickle
import tarfile
import urllib.error

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from fl_lightning.data import catalog, download, sources
from fl_lightning.federation import files
from fl_lightning.federation.errors import ConfigError


class FakeResponse(io.BytesIO):
    def __init__(self, data: bytes, url: str, headers: dict | None = None):
        super().__init__(data)
        self.url, self.headers = url, headers or {}

    def geturl(self):
        return self.url


def serve(monkeypatch, files: dict[str, bytes | Exception]) -> list[str]:
    """Replaces the network: ``files`` maps URLs to bytes (or an exception to raise); returns the URLs asked."""
    asked = []

    def fake_open(url, timeout=60.0):
        asked.append(url)
        answer = files.get(url, urllib.error.URLError("[Errno -2] Name or service not known"))
        if isinstance(answer, Exception):
            raise answer
        return FakeResponse(answer, url)

    monkeypatch.setattr(download, "_open", fake_open)
    return asked


def hub_client(monkeypatch, handle) -> None:
    """huggingface_hub's HTTP client (the one all its calls share) sends each request to ``handle``."""
    import httpx2
    from huggingface_hub import close_session, constants
    from huggingface_hub.utils import _detect_agent, _http

    def client():  # huggingface_hub's own client (its offline check, redirects, no timeout), another transport
        return httpx2.Client(
            event_hooks={"request": [_http.hf_request_event_hook]},
            follow_redirects=True,
            timeout=None,
            transport=httpx2.MockTransport(handle),
        )

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE") == "1")
    # huggingface_hub asks the Hub once a day for its list of coding agents (for its User-Agent): not here
    monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    close_session()
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT_FACTORY", client)
    monkeypatch.setattr(_http, "_GLOBAL_CLIENT", None)


def loopback_only(request):
    """Sends ``request`` on, if it is for 127.0.0.1: no test reaches the real Hub, whatever it is pointed at."""
    import httpx2

    assert request.url.host == "127.0.0.1", f"a test tried to reach {request.url}"
    with httpx2.Client(trust_env=False) as client:  # no proxy between the test and its stand-in
        response = client.send(request)
        response.read()
        return httpx2.Response(response.status_code, headers=response.headers, content=response.content)


def offline(monkeypatch) -> list[str]:
    """No network: urllib's downloads and huggingface_hub's requests fail as with no DNS; returns the URLs asked."""
    import httpx2

    asked = serve(monkeypatch, {})

    def unreachable(request):
        asked.append(str(request.url))
        raise httpx2.ConnectError("[Errno -2] Name or service not known", request=request)

    hub_client(monkeypatch, unreachable)
    return asked


# --- checksums -------------------------------------------------------------------------------------------


def test_a_corrupted_download_is_refused_and_deleted(tmp_path, monkeypatch):
    good = b"the published bytes"
    url = "https://example.org/file.bin"
    serve(monkeypatch, {url: good[:-1] + b"X"})  # one byte changed in transit
    target = tmp_path / "file.bin"
    with pytest.raises(ConfigError, match=r"failed its sha256 check.*deleted") as err:
        download.download(url, target, sha256=hashlib.sha256(good).hexdigest())
    assert "\n" not in str(err.value)
    assert not target.exists() and not (tmp_path / "file.bin.part").exists()
    serve(monkeypatch, {url: good})
    assert download.download(url, target, sha256=hashlib.sha256(good).hexdigest()).read_bytes() == good
    with pytest.raises(ConfigError, match="md5 check"):
        download.download(url, tmp_path / "other.bin", md5=hashlib.md5(b"something else").hexdigest())


def test_a_full_disk_during_a_download_names_the_file_not_the_network(tmp_path, monkeypatch):
    import errno
    import os

    url, target = "https://example.org/file.bin", tmp_path / "file.bin"
    serve(monkeypatch, {url: b"x" * 100_000})
    real_open = download.Path.open

    class Full(io.RawIOBase):
        def writable(self):
            return True

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_(path, mode="r", *args, **kwargs):  # the .part file fills the disk at its first write
        return Full() if str(path).endswith(".part") and "w" in mode else real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(download.Path, "open", open_)
    with pytest.raises(OSError) as raised:
        download.download(url, target, sha256=hashlib.sha256(b"x" * 100_000).hexdigest())
    assert not isinstance(raised.value, ConfigError)  # not "check the connection or proxy"
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert not target.exists() and not (tmp_path / "file.bin.part").exists()


def test_a_file_another_process_is_downloading_is_waited_for_and_not_fetched_again(tmp_path, monkeypatch):
    import fcntl
    import threading

    good = b"the published bytes"
    url, target = "https://example.org/file.bin", tmp_path / "file.bin"
    asked = serve(monkeypatch, {url: good})
    lock = (tmp_path / "file.bin.lock").open("ab")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another run (flrun table --n_jobs) is fetching it
    result = []
    waiting = threading.Thread(
        target=lambda: result.append(download.download(url, target, sha256=hashlib.sha256(good).hexdigest()))
    )
    waiting.start()
    waiting.join(timeout=0.5)
    assert waiting.is_alive() and not asked  # waits instead of writing the same .part file
    target.write_bytes(good)  # the other run's download lands
    lock.close()
    waiting.join(timeout=10)
    assert result == [target] and not asked


def test_a_download_on_a_file_system_without_locks_goes_on_without_one(tmp_path, monkeypatch):
    import errno

    def no_flock(file, operation):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(files.fcntl, "flock", no_flock)  # the lock download takes (files.lock_file)
    good = b"the published bytes"
    serve(monkeypatch, {"https://example.org/f.bin": good})
    path = download.download("https://example.org/f.bin", tmp_path / "f.bin", sha256=hashlib.sha256(good).hexdigest())
    assert path.read_bytes() == good


def test_downloads_need_https_and_a_checksum(tmp_path, monkeypatch):
    asked = serve(monkeypatch, {"http://example.org/a": b"x", "https://example.org/a": b"x"})
    with pytest.raises(ConfigError, match="only https"):
        download.download("http://example.org/a", tmp_path / "a", sha256="0" * 64)
    with pytest.raises(ConfigError, match="without a published checksum"):
        download.download("https://example.org/a", tmp_path / "a")
    assert asked == []  # refused before any connection


def test_a_redirect_to_plain_http_is_refused(tmp_path, monkeypatch):
    def redirected(url, timeout=60.0):
        return FakeResponse(b"x", "http://mirror.example.org/a")

    monkeypatch.setattr(download, "_open", redirected)
    with pytest.raises(ConfigError, match="non-https"):
        download.download("https://example.org/a", tmp_path / "a", sha256=hashlib.sha256(b"x").hexdigest())
    assert not (tmp_path / "a").exists()


def test_git_blob_sha1_is_gits_object_id():
    # `printf 'hello\n' | git hash-object --stdin`
    assert download.git_blob_sha1(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"


# --- tar extraction filter --------------------------------------------------------------------------------


def craft_tar(path, members):
    """members: (name, kind, payload) with kind file | symlink | hardlink."""
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = payload
                tar.addfile(info)
    return path


@pytest.mark.parametrize(
    "evil, why",
    [
        (("/tmp/fl_lightning_evil_abs.txt", "file", b"x"), "an absolute path"),
        (("../escaped.txt", "file", b"x"), "a path that leaves the folder"),
        (("data/../../escaped.txt", "file", b"x"), "a path that leaves the folder"),
        (("link", "symlink", "/etc"), "a symbolic link to the absolute path"),
        (("sub/link", "symlink", "../../.."), "a symbolic link to '../../..', outside"),
        (("hard", "hardlink", "../outside.txt"), "a hard link to '../outside.txt', outside"),
    ],
    ids=["absolute", "dotdot", "nested-dotdot", "symlink-absolute", "symlink-out", "hardlink-out"],
)
def test_tar_members_outside_the_folder_are_refused_and_nothing_is_extracted(tmp_path, evil, why):
    archive = craft_tar(tmp_path / "evil.tar.gz", [("ok/first.txt", "file", b"fine"), evil])
    dest = tmp_path / "data" / "inside"
    with pytest.raises(ConfigError, match=f"member {evil[0]!r} is {why}") as err:
        download.safe_extract(archive, dest)
    assert "\n" not in str(err.value)
    assert list(dest.rglob("*")) == []  # not even the harmless first member
    assert not (tmp_path / "data" / "escaped.txt").exists() and not (tmp_path / "escaped.txt").exists()


def test_a_well_formed_archive_extracts_with_links_that_stay_inside(tmp_path):
    archive = craft_tar(
        tmp_path / "good.tar.gz",
        [("d/a.txt", "file", b"alpha"), ("d/alias.txt", "symlink", "a.txt"), ("d/copy.txt", "hardlink", "d/a.txt")],
    )
    download.safe_extract(archive, tmp_path / "out")
    assert (tmp_path / "out/d/alias.txt").read_bytes() == b"alpha"
    assert (tmp_path / "out/d/copy.txt").read_bytes() == b"alpha"


# --- fetch: archives and Hub files through the real code path ---------------------------------------------


def cifar_archive(path):
    members = []
    for name, n in [(f"data_batch_{i}", 2) for i in range(1, 6)] + [("test_batch", 3)]:
        batch = {"data": np.full((n, 3072), 7, dtype=np.uint8), "labels": list(range(n))}
        members.append((f"cifar-10-batches-py/{name}", "file", pickle.dumps(batch)))
    return craft_tar(path, members).read_bytes()


def serve_cifar(tmp_path, monkeypatch) -> tuple[str, list[str]]:
    """CIFAR-10's source pointed at a served tiny archive in the real format; returns its URL and the URLs asked."""
    blob = cifar_archive(tmp_path / "archive.tar.gz")
    real = catalog.source("cifar10")
    url = "https://example.org/cifar-10-python.tar.gz"
    remote = dataclasses.replace(real.remotes[0], url=url, md5=hashlib.md5(blob).hexdigest())
    monkeypatch.setitem(catalog.NAMES, "cifar10", dataclasses.replace(real, remotes=(remote,)))
    return url, serve(monkeypatch, {url: blob})


def test_fetch_downloads_verifies_unpacks_and_the_loader_reads_it(tmp_path, monkeypatch, capsys):
    from conftest import run_cli

    from fl_lightning.data import Cifar10Data

    url, asked = serve_cifar(tmp_path, monkeypatch)
    data_dir = tmp_path / "data"
    assert run_cli("data", "fetch", "cifar10", "--data_dir", str(data_dir)) == 0
    assert "downloaded and verified, 6 files" in capsys.readouterr().out
    assert not (data_dir / "cifar-10-python.tar.gz").exists()  # the archive is removed once unpacked
    arrays = Cifar10Data(data_dir=str(data_dir), normalize="none").load()
    assert arrays.x.shape == (10, 3, 32, 32) and float(arrays.x[0, 0, 0, 0]) == pytest.approx(7 / 255)
    assert run_cli("data", "fetch", "Cifar10Data", "--data_dir", str(data_dir)) == 0  # class names work too
    assert "already in" in capsys.readouterr().out and asked == [url]  # present: not downloaded again
    assert not [p.name for p in data_dir.rglob("*.lock")]  # the locks go with the fetch


@pytest.mark.parametrize("name", ["cifar10", "femnist"])  # a download, and the Hub's listing
def test_a_failed_fetch_leaves_no_lock_file_and_no_folder_it_made(tmp_path, monkeypatch, capsys, name):
    from conftest import run_cli

    offline(monkeypatch)
    new = tmp_path / "new" / "data"
    assert run_cli("data", "fetch", name, "--data_dir", str(new)) == 2
    assert "check the connection" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither data/ nor new/ stays behind
    existing = tmp_path / "data"
    existing.mkdir()
    (existing / "mine.txt").write_text("a user's file")
    assert run_cli("data", "fetch", name, "--data_dir", str(existing)) == 2
    assert sorted(p.name for p in existing.iterdir()) == ["mine.txt"]  # no .lock file, the folder kept


def test_a_process_that_waited_on_a_removed_lock_file_locks_the_current_one(tmp_path):
    """The holder removes the lock file when done; one that opened the old file meanwhile must not hold a lock
    nobody else sees (two fetches would then write one file)."""
    import fcntl
    import threading

    path = tmp_path / "f.lock"
    held, second = [], files.lock_file(path)
    first = files.lock_file(path)
    first.__enter__()
    waiter = threading.Thread(target=lambda: held.append(second.__enter__()))
    waiter.start()
    waiter.join(timeout=0.3)
    assert waiter.is_alive() and not held
    first.__exit__(None, None, None)  # removes f.lock, then releases
    waiter.join(timeout=10)
    assert held and path.exists()  # the waiter holds the file that is there now
    other = path.open("ab")
    with pytest.raises(BlockingIOError):
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other.close()
    second.__exit__(None, None, None)
    assert not path.exists()


def test_runs_fetching_one_data_set_together_download_and_unpack_it_once(tmp_path, monkeypatch):
    import fcntl
    import threading

    url, asked = serve_cifar(tmp_path, monkeypatch)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    lock = (data_dir / ".cifar10.fetch.lock").open("ab")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another run is fetching it
    second = threading.Thread(target=lambda: sources.fetch("cifar10", data_dir))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive() and not asked
    sources._fetch_files(catalog.source("cifar10"), data_dir, None)  # the other run's work under its lock
    lock.close()
    second.join(timeout=10)
    assert not second.is_alive() and asked == [url]  # the waiting run found the files: fetched once


def png(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((28, 28), value, dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A stand-in of the Hub's API on 127.0.0.1 serving flwrlabs/femnist, with huggingface_hub pointed at it
    (its endpoint and cache are read when it is imported, so its constants are set as HF_ENDPOINT would)."""
    from hub_standin import HubStandIn
    from huggingface_hub import constants

    with HubStandIn("flwrlabs/femnist") as stand_in:
        monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(constants, "ENDPOINT", stand_in.url)
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", stand_in.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-home/hub"))
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home/token"))
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        hub_client(monkeypatch, loopback_only)
        yield stand_in


def test_hub_files_are_pinned_checked_and_read_by_the_femnist_loader(tmp_path, hub):
    from fl_lightning.data import FemnistData

    table = pd.DataFrame(
        {
            "image": [{"bytes": png(255 * (i % 2)), "path": None} for i in range(20)],
            "writer_id": [f"w{i % 4}" for i in range(20)],
            "character": [i % 62 for i in range(20)],
        }
    )
    parquet = io.BytesIO()
    table.to_parquet(parquet)
    blob = parquet.getvalue()
    commit = "c" * 40
    parquet_path = "data/train-00000-of-00001.parquet"
    # three entries and a folder: the listing comes in two pages
    files = {parquet_path: blob, "README.md": b"card", "data/notes.txt": b"not a parquet file"}
    hub.refs.update({"main": commit, commit: commit})
    hub.trees[commit] = files
    # downloads by default, as the Hub loader always did; 0.2 of each writer's 5 images: one test image each
    data = FemnistData(data_dir=str(tmp_path), test_fraction=0.2)
    data.setup(num_clients=4, seed=0)
    # main resolved to its commit first, the listing read page by page, the file fetched at that commit only
    api = "/api/datasets/flwrlabs/femnist"
    assert hub.asked[0] == f"GET {api}/revision/main"
    assert [a for a in hub.asked if "/tree/" in a] == [f"GET {api}/tree/{commit}"] * 2
    assert [a for a in hub.asked if "/resolve/" in a] == [
        f"{method} /datasets/flwrlabs/femnist/resolve/{commit}/{parquet_path}" for method in ("HEAD", "GET")
    ]
    assert (tmp_path / "femnist/hub/REVISION").read_text().split() == ["flwrlabs/femnist", commit]
    assert len(data.y) + len(data.test_y) == 20 and sorted(set(data.groups)) == ["w0", "w1", "w2", "w3"]
    # the loader's folder holds the verified files only (no download locks), and nothing is left staged
    assert sorted(p.name for p in (tmp_path / "femnist/hub").iterdir()) == ["REVISION", "train-00000-of-00001.parquet"]
    assert not (tmp_path / ".fetch").exists()
    assert {float(v) for v in data.x.amax(dim=(1, 2, 3))} | {float(v) for v in data.x.amin(dim=(1, 2, 3))} == {
        0.0,
        1.0,
    }
    with pytest.raises(ConfigError, match=f"is commit {commit}, not the requested {'d' * 40}"):
        FemnistData(data_dir=str(tmp_path), hub_revision="d" * 40).load()
    # a corrupted Hub file (one byte changed, the Hub's headers unchanged): refused, nothing left where the
    # loader reads
    other = "e" * 40
    hub.refs[other] = other
    hub.trees[other] = files
    hub.served[(other, parquet_path)] = blob[:-1] + bytes([blob[-1] ^ 1])
    with pytest.raises(ConfigError, match="failed its sha256 check") as err:
        sources.fetch("femnist", tmp_path / "fresh", revision=other)
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "fresh").rglob("*.parquet"))
    assert not (tmp_path / "fresh/femnist").exists() and not (tmp_path / "fresh/.fetch").exists()


def test_a_hub_revision_that_does_not_exist_is_named_in_one_sentence(tmp_path, hub):
    hub.refs["main"] = "c" * 40
    with pytest.raises(ConfigError, match=r"flwrlabs/femnist has no revision 'v9'; give one of its branches") as err:
        sources.fetch("femnist", tmp_path, revision="v9")
    assert "\n" not in str(err.value) and hub.asked == ["GET /api/datasets/flwrlabs/femnist/revision/v9"]
    assert list(tmp_path.iterdir()) == []


def test_a_hub_file_cut_short_is_a_network_error_and_leaves_nothing(tmp_path, hub):
    commit = "c" * 40
    hub.refs["main"] = commit
    hub.trees[commit] = {"data/train.parquet": b"the published parquet bytes"}
    hub.served[(commit, "data/train.parquet")] = b"the published"  # the connection dropped midway
    with pytest.raises(download.NetworkError, match=r"file should be of size 27 but has size 13.*check the connection"):
        sources.fetch("femnist", tmp_path / "data")
    assert not (tmp_path / "data").exists()


def test_hub_offline_mode_is_named_and_nothing_is_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    asked = offline(monkeypatch)
    with pytest.raises(ConfigError, match=r"FEMNIST not found and could not be downloaded \(OfflineModeIsEnabled: "
                       r"HF_HUB_OFFLINE is set\): expected .*flrun data fetch femnist"):  # fmt: skip
        _vision("FemnistData")(tmp_path / "data")
    assert asked == []


# --- offline: one sentence per data set -------------------------------------------------------------------


def _vision(cls, **kw):
    return lambda d: getattr(__import__("fl_lightning.data", fromlist=[cls]), cls)(data_dir=d, **kw).load()


def _stackoverflow_c4(d):
    import h5py

    from fl_lightning.data import StackOverflowData

    root = d / "stackoverflow"
    root.mkdir(parents=True)
    (root / "stackoverflow.word_count").write_text("the 100\n")
    for split in ("train", "test"):
        with h5py.File(root / f"stackoverflow_{split}.h5", "w") as f:
            f.create_dataset("examples/u1/tokens", data=[b"the"])
            f.create_dataset("examples/u1/type", data=[b"question"])
    StackOverflowData(data_dir=d, download=True, vocab_size=1, distillation_texts="hub").setup(1, 0)


def _vit(d):
    from fl_lightning.models import registered_models

    registered_models()["vit_b16"](pretrained_dir=str(d), fetch_weights=sources.fetch_pretrained)


OFFLINE_CASES = {
    "cifar10": _vision("Cifar10Data", download=True),
    "cifar100": _vision("Cifar100Data", download=True),
    "mnist": _vision("MnistData", download=True),
    "cinic10": _vision("Cinic10Data", download=True),
    "speech_commands": _vision("SpeechCommandsData", download=True),
    "fed_cifar100": _vision("FedCifar100Data", download=True),
    "stackoverflow": _vision("StackOverflowData", download=True),
    "femnist": _vision("FemnistData"),
    "imdb": _vision("ImdbData"),
    "c4": _stackoverflow_c4,
    "vit_b16": _vit,
}


@pytest.mark.parametrize("name", list(OFFLINE_CASES))
def test_offline_every_data_set_fails_in_one_sentence_naming_files_and_fetch(tmp_path, monkeypatch, capfd, name):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # an empty Hub cache
    asked = offline(monkeypatch)
    data_dir = tmp_path / "data"
    with pytest.raises(ConfigError) as err:
        OFFLINE_CASES[name](data_dir)
    message = str(err.value)
    src = catalog.source(name)
    assert "\n" not in message and message.count(". ") == 0, message  # one sentence
    failure = "ConnectError" if src.hub else "URLError"  # huggingface_hub's client (httpx) or urllib
    assert f"{src.title} not found and could not be downloaded ({failure}: [Errno -2]" in message
    assert f"expected {data_dir / src.layout}" in message
    assert f"`flrun data fetch {name} --data_dir {data_dir}`" in message
    assert len(asked) == 1  # one attempt, no retries
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""  # and no noise before the sentence


@pytest.mark.parametrize("name", ["cifar10", "speech_commands", "fed_cifar100"])
def test_without_download_the_sentence_offers_it_and_nothing_is_fetched(tmp_path, monkeypatch, name):
    cls = {"cifar10": "Cifar10Data", "speech_commands": "SpeechCommandsData", "fed_cifar100": "FedCifar100Data"}
    asked = offline(monkeypatch)
    with pytest.raises(ConfigError, match=rf"not found: expected .*flrun data fetch {name}.*or set download: true\.$"):
        _vision(cls[name])(tmp_path)
    assert asked == []


def test_vit_with_hub_offline_set_does_not_touch_the_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    asked = offline(monkeypatch)
    with pytest.raises(ConfigError, match=r"ViT-B/16 weights not found: expected .*model\.safetensors.*vit_b16"):
        _vit(tmp_path)
    assert asked == []


def test_an_offline_paper_recipe_exits_2_with_one_line(tmp_path, monkeypatch, capfd):
    from conftest import ROOT, run_cli

    offline(monkeypatch)
    rc = run_cli(
        "fit", "--config", str(ROOT / "recipes/ondevice_kd_cifar100.yaml"), "--output_dir", str(tmp_path / "run"),
        "--data.init_args.data_dir", str(tmp_path / "data"), "--runtime.progress", "false",
    )  # fmt: skip
    err = capfd.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "CIFAR-100 not found and could not be downloaded" in err and "flrun data fetch cifar100" in err


def test_fetch_names_unknown_data_sets_in_one_sentence(capsys):
    from conftest import run_cli

    assert run_cli("data", "fetch", "cifar11") == 2
    err = capsys.readouterr().err
    assert "unknown data set 'cifar11'" in err and "cifar10, cifar100" in err and err.count("\n") == 1
