"""Conversations saved by name beside the disk tier (kvcache.tiers.saved_prompts): a name is never a
path, files are private, nothing is reached through a link, oversized or foreign files are refused."""

from __future__ import annotations

import os
import stat

import pytest

from kvcache.tiers.saved_prompts import MAX_FILE_BYTES, SavedPromptError, SavedPrompts, check_name

SAVED = {"namespace": "0" * 32, "cache_salt": None, "tokens": [1, 2, 3]}


@pytest.mark.parametrize("name", ["", ".", "..", "a..b", ".hidden", "a/b", "/etc/passwd", "a\\b", "a b",
                                  "x" * 129, "-flag", "ü", None, 7])
def test_a_name_that_could_be_a_path_or_is_not_a_plain_name_is_refused(name):
    with pytest.raises(SavedPromptError, match="letters, digits"):
        check_name(name)


@pytest.mark.parametrize("name", ["a", "support-42", "Conv_1.v2", "x" * 128])
def test_plain_names_are_taken(name):
    assert check_name(name) == name


def test_saved_files_are_private_and_read_back_erased_and_listed(tmp_path):
    saved = SavedPrompts(tmp_path)
    before = os.umask(0)  # (the modes hold whatever the umask)
    try:
        assert saved.read("conv") is None and saved.names() == []
        assert saved.write("conv", SAVED) > 0
    finally:
        os.umask(before)
    assert saved.read("conv") == SAVED and saved.names() == ["conv"]
    assert stat.S_IMODE((tmp_path / "slots").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "slots" / "conv.json").stat().st_mode) == 0o600
    saved.write("conv", {**SAVED, "tokens": [4]})  # replaced whole
    assert saved.read("conv")["tokens"] == [4]
    assert sorted(os.listdir(tmp_path / "slots")) == ["conv.json"]  # (no temporary file left)
    assert saved.erase("conv") and not saved.erase("conv") and saved.read("conv") is None


def test_a_slots_folder_that_is_a_link_is_refused_and_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    disk = tmp_path / "disk"
    disk.mkdir()
    (disk / "slots").symlink_to(elsewhere)
    with pytest.raises(SavedPromptError, match="symbolic link"):
        SavedPrompts(disk).write("conv", SAVED)
    assert os.listdir(elsewhere) == []


def test_a_saved_file_that_is_a_link_is_never_read_and_erasing_removes_only_the_link(tmp_path):
    target = tmp_path / "target.json"
    target.write_text('{"tokens": [1]}')
    saved = SavedPrompts(tmp_path / "disk")
    (tmp_path / "disk").mkdir()
    saved.names()  # (makes the folder)
    (tmp_path / "disk" / "slots" / "conv.json").symlink_to(target)
    assert saved.names() == []
    with pytest.raises(SavedPromptError, match="symbolic link"):
        saved.read("conv")
    assert saved.erase("conv") and target.read_text() == '{"tokens": [1]}'


def test_a_file_too_large_or_not_a_json_object_is_refused(tmp_path):
    saved = SavedPrompts(tmp_path)
    saved.write("big", SAVED)
    os.truncate(tmp_path / "slots" / "big.json", MAX_FILE_BYTES + 1)  # (sparse: nothing allocated)
    with pytest.raises(SavedPromptError, match="regular file of at most"):
        saved.read("big")
    (tmp_path / "slots" / "list.json").write_text("[1, 2]")
    with pytest.raises(SavedPromptError, match="not a JSON object"):
        saved.read("list")
