"""planner.outputs: destinations checked before the work, nothing left behind."""

import pytest

from costmodel.specs.loading import SpecError
from planner.outputs import check_folder, check_writable, write_atomic


def test_a_folder_that_can_be_made_passes_and_is_not_left_behind(tmp_path):
    check_folder(tmp_path / "a" / "b" / "ckpt", "--checkpoint-dir")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_folder_passes_and_keeps_only_its_own_files(tmp_path):
    (tmp_path / "kept").write_text("x")
    check_folder(tmp_path, "--checkpoint-dir")
    assert [p.name for p in tmp_path.iterdir()] == ["kept"]


@pytest.mark.parametrize("path, text", [
    ("/proc/shardwise-ckpt", "cannot write under /proc/shardwise-ckpt"),   # access() says yes as root
    ("", "expected a folder path"),
    ("x" * 300, "cannot"),
])
def test_folders_that_cannot_hold_files_are_refused_by_name(path, text):
    with pytest.raises(SpecError, match="--checkpoint-dir") as err:
        check_folder(path, "--checkpoint-dir")
    assert text in str(err.value)


def test_a_file_is_not_a_folder(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(SpecError, match="is a file, not a folder"):
        check_folder(tmp_path / "f", "--checkpoint-dir")
    with pytest.raises(SpecError, match="cannot write under"):
        check_folder(tmp_path / "f" / "sub", "--checkpoint-dir")


def test_write_atomic_replaces_and_leaves_no_tmp(tmp_path):
    target = tmp_path / "plan.json"
    check_writable(target, "-o")
    write_atomic(target, "one", "-o")
    write_atomic(target, b"two", "-o")
    assert target.read_text() == "two" and [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_check_writable_refuses_a_missing_folder_and_a_folder(tmp_path):
    with pytest.raises(SpecError, match="-o: cannot write"):
        check_writable(tmp_path / "missing" / "p.json", "-o")
    with pytest.raises(SpecError, match="is a folder"):
        check_writable(tmp_path, "-o")
    assert list(tmp_path.iterdir()) == []
