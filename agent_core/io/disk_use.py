"""Disk use of folders as `du` counts it: every file, folder and link once per inode (a hard link is not
counted twice), by the blocks it holds; and the bytes deleting a folder would free. Stat walks only: no
file is read and no symbolic link followed, so they are cheap on checkpoints of any size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from stat import S_ISDIR

Inode = tuple[int, int]  # (st_dev, st_ino)
_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def _entries(path: Path) -> Iterator[os.stat_result]:
    """The lstat of `path` and of everything under it; what vanishes or cannot be read is skipped
    (a live run replaces files while it is measured)."""
    try:
        yield os.lstat(path)
    except OSError:
        return
    for root, dirs, files in os.walk(path):  # never descends into a linked folder (followlinks=False)
        for name in (*dirs, *files):
            try:
                yield os.lstat(os.path.join(root, name))
            except OSError:
                continue


def inode_blocks(path: Path) -> dict[Inode, int]:
    """Bytes allocated (st_blocks x 512, as `du`) by each inode under `path`, the folder itself included."""
    return {(stat.st_dev, stat.st_ino): stat.st_blocks * 512 for stat in _entries(Path(path))}


def disk_use(path: Path) -> int:
    """What `du -s --block-size=1 path` says: bytes allocated under `path`, each inode once."""
    return sum(inode_blocks(path).values())


def disk_uses(paths: Sequence[Path]) -> tuple[list[int], list[int]]:
    """Each path's `disk_use`, and what each adds to the ones before it (an inode already counted under
    an earlier path adds nothing): sum(added) is the disk use of all of them together. One walk each."""
    seen: set[Inode] = set()
    own, added = [], []
    for path in paths:
        blocks = inode_blocks(path)
        own.append(sum(blocks.values()))
        added.append(sum(size for inode, size in blocks.items() if inode not in seen))
        seen.update(blocks)
    return own, added


def freed_by_deleting(*paths: Path | None) -> int:
    """The file bytes (st_size) deleting the folders or files `paths` together frees: a file counts only
    when each of its names (st_nlink) is under them, so one a hard link elsewhere keeps (a registered
    model version's, the run's checkpoint) counts 0; 0 when nothing is there."""
    names: dict[Inode, int] = {}
    stats: dict[Inode, os.stat_result] = {}
    for stat in (entry for path in paths if path is not None for entry in _entries(Path(path))):
        if not S_ISDIR(stat.st_mode):
            inode = (stat.st_dev, stat.st_ino)
            names[inode] = names.get(inode, 0) + 1
            stats[inode] = stat
    return sum(stat.st_size for inode, stat in stats.items() if stat.st_nlink <= names[inode])


def human_bytes(count: int) -> str:
    """1000-based, one decimal from a kilobyte on: "512 B", "12.3 kB", "1.6 GB"."""
    value, unit = float(count), 0
    while unit < len(_UNITS) - 1 and round(value, 1) >= 1000:
        value, unit = value / 1000, unit + 1
    return f"{int(count)} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"
