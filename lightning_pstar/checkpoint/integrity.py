"""Checksums: every checkpoint file carries one, written with it and checked before it is read.

- A file written by ``torch.save`` is a zip archive whose every record (the pickle, each tensor storage) has a
  CRC32 in its header, computed as it is written. torch's reader does not check them (its zip reader is built
  without CRC checks), so :func:`verify_torch_file` does, with :mod:`zipfile`: a truncated file or one flipped
  byte anywhere in a record is found and named. Consolidated files stay ordinary torch files that plain
  ``torch.load`` and Lightning read unchanged.
- The files of a sharded store (``.metadata``, ``__<rank>_<i>.distcp``) are raw bytes without checksums: each
  rank computes the CRC32 of the files it wrote (:func:`file_checksums`) and ``meta.pt`` keeps the table;
  :func:`verify_checksums` checks it on load.
"""

from __future__ import annotations

import pickle
import re
import zipfile
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

__all__ = [
    "CHUNK_BYTES",
    "ChecksumMismatch",
    "crc32_of",
    "describe_damage",
    "file_checksums",
    "verify_checksums",
    "verify_torch_file",
]

CHUNK_BYTES = 1 << 20  # read files in 1 MiB pieces: the checksum holds 1 MiB of a file at a time (8 MiB: +8 MiB peak)


class ChecksumMismatch(ValueError):
    """A file's bytes do not match the checksum written with it (the caller names the checkpoint)."""


def crc32_of(path: Path) -> int:
    """CRC32 of the bytes of ``path``."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK_BYTES):
            crc = zlib.crc32(block, crc)
    return crc


def file_checksums(directory: Path, names: Iterable[str]) -> dict[str, dict[str, int]]:
    """``{name: {"crc32": ..., "bytes": ...}}`` of the files ``names`` in ``directory``."""
    return {name: {"crc32": crc32_of(directory / name), "bytes": (directory / name).stat().st_size} for name in names}


def verify_checksums(directory: Path, table: Mapping[str, Mapping[str, int]]) -> None:
    """Raise :class:`ChecksumMismatch` naming the first file of ``table`` that is missing, cut short or changed."""
    for name, want in sorted(table.items()):
        path = directory / name
        if not path.is_file():
            raise ChecksumMismatch(f"'{path}' is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise ChecksumMismatch(f"'{path}' has {size} bytes, {want['bytes']} were written (truncated or appended)")
        crc = crc32_of(path)
        if crc != want["crc32"]:
            raise ChecksumMismatch(
                f"'{path}' fails its checksum (crc32 {crc:08x}, written {want['crc32']:08x}): its bytes changed"
            )


def verify_torch_file(path: Path) -> None:
    """Check every record CRC32 of a ``torch.save`` zip file; raise :class:`ChecksumMismatch` naming the record.

    A file that is not a zip archive at all (torch's legacy format, or something else) is left to ``torch.load``
    to judge; a file that was a zip archive and lost its end (truncated) is reported here.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            if infos and all(info.CRC == 0 for info in infos if info.file_size):
                return  # written with torch.serialization.set_crc32_options(False): no checksums to check
            for info in infos:
                with archive.open(info) as record:  # zipfile checks the CRC32 when the record is read whole
                    while record.read(CHUNK_BYTES):
                        pass
    except zipfile.BadZipFile as err:
        if "Bad CRC-32" in str(err):
            raise ChecksumMismatch(f"'{path}' fails its checksum ({describe_damage(err)}): its bytes changed") from err
        if _looks_like_zip(path):  # else not a zip archive: torch.load judges it
            raise ChecksumMismatch(f"'{path}' is damaged: {describe_damage(err)}") from err
    except (EOFError, zipfile.LargeZipFile, OSError, ValueError) as err:
        raise ChecksumMismatch(f"'{path}' is damaged: {describe_damage(err)}") from err


_BYTES_LITERAL = re.compile(r"""b(['"]).*?(?<!\\)\1""")
_ESCAPES = re.compile(r"\\x[0-9a-fA-F]{2}|[^\x20-\x7e]")
_MAX_DETAIL = 160


def describe_damage(err: BaseException) -> str:
    """What is wrong with a damaged checkpoint file, in words: the exceptions of ``zipfile``, ``pickle`` and text
    decoding quote the damaged bytes themselves (``File name in directory 'archive/data.pkl' and header
    b'ar\\xc8...' differ``), which tell a user nothing and may be unprintable; the damage is named instead."""
    text = str(err)
    if isinstance(err, zipfile.BadZipFile):
        if "File name in directory" in text:
            return "a record's local zip header does not match the archive's directory (its header bytes changed)"
        if "Bad magic number" in text:
            return "a record's local zip header is damaged"
        if "not a zip file" in text:
            return "its zip directory (at the end of the file) is missing or damaged: the file was cut short or changed"
        if "Bad CRC-32" in text:
            name = re.search(r"for file (.+)$", text)
            return f"record {name.group(1)} has the wrong CRC-32" if name else "a record has the wrong CRC-32"
    if isinstance(err, pickle.UnpicklingError) and "invalid load key" in text:
        return "it does not start like a file torch.save writes (neither a zip archive nor a pickle)"
    if isinstance(err, UnicodeDecodeError):
        return "a record name is not valid text (the zip header bytes changed)"
    if isinstance(err, EOFError):
        return "it ends before its last record (cut short)"
    detail = _ESCAPES.sub("?", _BYTES_LITERAL.sub("<bytes>", text))
    if len(detail) > _MAX_DETAIL:
        detail = detail[: _MAX_DETAIL - 3] + "..."
    return f"{type(err).__name__}: {detail}"


def _looks_like_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"
