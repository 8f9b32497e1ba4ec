"""Atomic writes (hif8qat.files): a failure mid-write keeps the old file and leaves no temporary file; a
success replaces the file's content."""

from __future__ import annotations

import json
import os
import stat

import pytest

from hif8qat.files import atomic_path, write_bytes, write_json, write_text


def test_success_replaces_the_file_and_leaves_nothing_else(tmp_path):
    target = tmp_path / "results.json"
    target.write_text("old")
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target  # same folder: the rename stays on one file system
        tmp.write_text("new")
        assert target.read_text() == "old"  # not published before the block ends
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_a_failure_mid_write_keeps_the_old_file_and_removes_the_temporary_one(tmp_path, error):
    target = tmp_path / "summary.json"
    target.write_text('{"status": "finished"}')
    with pytest.raises(type(error)):
        with atomic_path(target) as tmp:
            tmp.write_text('{"status": "runn')  # half written when the failure comes
            raise error
    assert target.read_text() == '{"status": "finished"}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_failure_before_the_first_write_leaves_no_file_at_all(tmp_path):
    target = tmp_path / "new.txt"
    with pytest.raises(ValueError):
        with atomic_path(target):
            raise ValueError("nothing written")
    assert list(tmp_path.iterdir()) == []


def test_conveniences_write_what_they_are_given_into_a_new_folder(tmp_path):
    write_text(tmp_path / "a" / "t.txt", "héllo\n")
    write_bytes(tmp_path / "a" / "b.bin", b"\x00\xff")
    write_json(tmp_path / "a" / "j.json", {"b": 1, "a": [1.5, None]}, sort_keys=True)
    assert (tmp_path / "a" / "t.txt").read_bytes() == "héllo\n".encode()
    assert (tmp_path / "a" / "b.bin").read_bytes() == b"\x00\xff"
    assert (tmp_path / "a" / "j.json").read_text() == '{"a": [1.5, null], "b": 1}\n'
    assert json.loads((tmp_path / "a" / "j.json").read_text()) == {"a": [1.5, None], "b": 1}
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b.bin", "j.json", "t.txt"]


@pytest.mark.parametrize("umask", [0o077, 0o002, 0o022])
def test_written_files_get_the_mode_a_plain_open_gets_under_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        (tmp_path / "plain").write_text("x")  # the oracle: what the user's umask gives any new file
        write_text(tmp_path / "ours", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "ours").stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode)


@pytest.mark.parametrize(("n", "binary", "text"), [
    (None, False, "unknown"), (999, False, "999 B"), (1000, False, "1.0 kB"), (1_500_000, False, "1.5 MB"),
    (2.5e12, False, "2.5 TB"), (3e15, False, "3000.0 TB"),
    (1023, True, "1023 B"), (1024, True, "1.0 KiB"), (3 * 2 ** 19, True, "1.5 MiB"), (2 ** 30, True, "1.0 GiB"),
    (25_227_005_952, True, "23.5 GiB"), (2 ** 50, True, "1024.0 TiB"),
])
def test_byte_counts_read_in_decimal_or_binary_units(n, binary, text):
    """Disks in decimal units as df -H shows them, memory in binary ones as the GiB of the memory estimate."""
    from hif8qat.files import human_bytes

    assert human_bytes(n, binary=binary) == text
