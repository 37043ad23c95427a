"""fl_lightning.federation.files: a file the project writes for a user is replaced whole or not at all, a failed
write names the file and leaves no partial file, and a stop during a write takes effect once it is done."""

from __future__ import annotations

import errno
import os
import signal

import pytest
import torch

from fl_lightning.federation.files import atomic_write, replacing, write_synced


def _full_disk_after(monkeypatch, room: int) -> None:
    """The files that ``fl_lightning.federation.files`` opens take ``room`` bytes in all, then a write fails
    with ENOSPC (a disk that fills up during the write), after writing what still fitted."""
    import fl_lightning.federation.files as files

    written = [0]

    class Filling:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if written[0] + len(data) > room:
                self.f.write(data[: room - written[0]])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written[0] += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(files, "open", lambda path, mode="r": Filling(open(path, mode)), raising=False)


def test_a_full_disk_keeps_the_old_file_whole_leaves_no_partial_file_and_names_the_file(tmp_path, monkeypatch):
    target = tmp_path / "report.html"
    target.write_text("the user's report\n")
    _full_disk_after(monkeypatch, room=10)
    with pytest.raises(OSError) as raised:
        atomic_write(target, "x" * 100)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert target.read_text() == "the user's report\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


def test_torch_save_on_a_full_disk_is_an_os_error_naming_the_file_not_torch_s_runtime_error(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    torch.save({"round": 1}, target)
    before = target.read_bytes()
    _full_disk_after(monkeypatch, room=100)
    with pytest.raises(OSError) as raised, replacing(target) as f:
        torch.save({"weights": torch.zeros(10_000)}, f)
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(target)
    assert target.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_an_error_inside_the_block_leaves_the_old_file_and_no_temporary_file(tmp_path):
    target = tmp_path / "sweep.json"
    target.write_text("{}\n")
    with pytest.raises(KeyboardInterrupt), replacing(target) as f:
        f.write(b'{"half": ')
        raise KeyboardInterrupt
    assert target.read_text() == "{}\n" and sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]


def test_a_new_file_and_its_folder_are_made_and_text_is_utf8(tmp_path):
    atomic_write(tmp_path / "a" / "b" / "table.md", "naïve | ✓\n")
    assert (tmp_path / "a/b/table.md").read_bytes() == "naïve | ✓\n".encode()


@pytest.mark.parametrize("stop, raised", [(signal.SIGTERM, "Terminated"), (signal.SIGINT, "KeyboardInterrupt")])
def test_a_signal_during_a_write_takes_effect_after_it_with_the_file_complete(tmp_path, stop, raised):
    class Terminated(BaseException):
        pass

    def terminate(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    target = tmp_path / "last.ckpt"
    state = {"weights": torch.arange(50_000.0)}

    class Signalling:  # the signal arrives in the middle of torch.save's writes
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                os.kill(os.getpid(), stop)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    try:
        with pytest.raises((Terminated, KeyboardInterrupt)) as caught, replacing(target) as f:
            torch.save(state, Signalling(f))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert type(caught.value).__name__ == raised  # the stop itself, not torch's "unexpected pos"
    assert torch.equal(torch.load(target, weights_only=True)["weights"], state["weights"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_a_file_written_once_is_removed_when_its_write_fails(tmp_path):
    target = tmp_path / "3-00aa-1.pt"

    def fail(f):
        f.write(b"partial")
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    with pytest.raises(OSError) as raised:
        write_synced(target, fail)
    assert raised.value.filename == str(target) and not target.exists()


def test_a_directory_where_the_file_goes_is_named_and_left_alone(tmp_path):
    (tmp_path / "report.html").mkdir()
    with pytest.raises(OSError) as raised:
        atomic_write(tmp_path / "report.html", "page")
    assert raised.value.filename == str(tmp_path / "report.html")
    assert (tmp_path / "report.html").is_dir() and not (tmp_path / "report.html.tmp").exists()
