"""Issue 31: a damaged file's message names the file and the damage in words (no raw bytes), and a sharded
checkpoint a save set aside (a filesystem without the atomic exchange, killed mid-publish) is found and put back
by the consolidate command and by every PatrickStar load."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from lightning_pstar import PatrickStarStrategy
from lightning_pstar.checkpoint import CheckpointError, consolidate, load_checkpoint_file, main, restore_set_aside
from lightning_pstar.checkpointing import SafeCheckpointIO
from tests.helpers import TinyLM, make_loader
from tests.helpers.killpoints import make_real_directory, prepare, tensors_of, version_at
from tests.helpers.runs import make_trainer


def _assert_no_raw_bytes(message: str) -> None:
    assert "b'" not in message and 'b"' not in message and "\\x" not in message, message
    assert all(" " <= c <= "~" for c in message), message


def _torch_file(path: Path) -> None:
    torch.save({"state_dict": tensors_of(1), "global_step": 1}, path)


def _record_name_offset(path: Path) -> int:
    """Offset of the first record's name in its local zip header (30 bytes of fixed fields before it)."""
    with zipfile.ZipFile(path) as archive:
        return archive.infolist()[0].header_offset + 30


def test_a_damaged_zip_header_is_named_in_words(tmp_path: Path) -> None:
    """One letter of a record's name in its local header changed: zipfile's own message quotes the header's raw
    bytes (``header b'...' differ``); ours names the file and says what is damaged."""
    path = tmp_path / "plain.ckpt"
    _torch_file(path)
    data = bytearray(path.read_bytes())
    offset = _record_name_offset(path)
    data[offset] = ord("Z") if data[offset] != ord("Z") else ord("Y")
    path.write_bytes(bytes(data))
    with pytest.raises(zipfile.BadZipFile, match="header b'"):  # what zipfile itself says
        with zipfile.ZipFile(path) as archive:
            archive.read(archive.infolist()[0])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(path)
    message = str(info.value)
    assert str(path) in message and "local zip header does not match" in message and "HINT" in message
    _assert_no_raw_bytes(message)


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        ("start", "does not start like a file torch.save writes"),
        ("name-bytes", "record name is not valid text"),
        ("truncated", "zip directory (at the end of the file) is missing or damaged"),
    ],
)
def test_other_damage_is_named_in_words(damage: str, words: str, tmp_path: Path) -> None:
    path = tmp_path / "plain.ckpt"
    _torch_file(path)
    data = bytearray(path.read_bytes())
    if damage == "start":
        data[0:4] = b"\x00\xff\x13\x37"
    elif damage == "name-bytes":
        offset = _record_name_offset(path)
        data[offset : offset + 4] = bytes([0xC8, 0xC9, 0xCA, 0xCB])
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint_file(path)
    message = str(info.value)
    assert str(path) in message and words in message
    _assert_no_raw_bytes(message)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _set_aside(path: Path, pid: int) -> Path:
    """What a save killed between setting the directory aside and publishing its replacement leaves."""
    aside = path.with_name(f".{path.name}.pstar-aside-{pid}")
    os.replace(path, aside)
    return aside


class _SaveAt(L.Callback):
    """Saves at the end of the first step, while the engine (and its sharded format) is set up."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.path)


def _sharded_checkpoint(tmp_path: Path) -> tuple[Path, TinyLM]:
    """A real sharded checkpoint of a 1-step run, copied into a real directory (``cp -rL``): the name a save
    must set aside where the filesystem has no atomic exchange."""
    root = tmp_path / "ckpts"
    root.mkdir()
    path = root / "last.ckpt"
    module = TinyLM()
    trainer = make_trainer(strategy=PatrickStarStrategy(checkpoint="sharded"), max_steps=1, callbacks=[_SaveAt(path)])
    trainer.fit(module, make_loader(n_seq=4))
    make_real_directory(path)
    return path, module


def test_the_consolidate_command_puts_a_set_aside_checkpoint_back(tmp_path: Path) -> None:
    path, module = _sharded_checkpoint(tmp_path)
    aside = _set_aside(path, _dead_pid())
    out = tmp_path / "out.ckpt"
    assert main([str(path), str(out)]) == 0
    assert path.is_dir() and not aside.exists()
    loaded = TinyLM.load_from_checkpoint(str(out))  # plain Lightning reads the consolidated file
    for name, value in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value.detach().cpu()), name


def test_the_loader_puts_a_set_aside_checkpoint_back(tmp_path: Path) -> None:
    path, _ = _sharded_checkpoint(tmp_path)
    _set_aside(path, _dead_pid())
    trainer = make_trainer(strategy=PatrickStarStrategy(checkpoint="sharded"), max_steps=2)
    trainer.fit(TinyLM(), make_loader(n_seq=8), ckpt_path=str(path))
    assert trainer.global_step == 2 and path.is_dir()


def test_a_save_in_flight_is_left_alone(tmp_path: Path) -> None:
    """The entry of a writer that is still running (here: this test's parent process) is not touched."""
    path = prepare(tmp_path, "sharded", "real-directory")
    aside = _set_aside(path, os.getppid())
    assert restore_set_aside(path) is None and aside.is_dir()
    with pytest.raises(CheckpointError, match="does not exist"):
        consolidate(path, tmp_path / "out.ckpt")
    assert aside.is_dir() and not path.exists()
    with pytest.raises(CheckpointError, match="does not exist"):
        SafeCheckpointIO().load_checkpoint(path)


def test_nothing_happens_when_the_name_is_taken(tmp_path: Path) -> None:
    path = prepare(tmp_path, "sharded", "real-directory")
    assert restore_set_aside(path) is None and version_at(path, "sharded") == 1
