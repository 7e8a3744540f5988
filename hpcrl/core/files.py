"""File checksums shared by the ranks that write checkpoint shards and the driver that commits them."""

from __future__ import annotations

import zlib
from pathlib import Path


def crc32_of(path: Path) -> int:
    """CRC-32 of a file's bytes, read 16 MiB at a time."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc
