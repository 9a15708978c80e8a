"""Stage manifests: when a stage's outputs are complete, and when a rerun may reuse them.

A stage writes each output atomically, then, last and atomically, its manifest
(`<owner>/_manifests/<stage>.json`): the commit record, with a hash of its parameters and SHA-256 fingerprints
of its inputs and outputs. A rerun skips a stage only when all of these still match; else it and everything
downstream rerun. Outputs are recorded relative to their owner, so a moved data root checks its own files.
Design notes: docs/architecture.md §11 (agent_core/io/manifests.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from agent_core.io.atomic import atomic_file
from agent_core.io.tombstones import read_tombstone

log = logging.getLogger(__name__)

MANIFEST_VERSION = 2  # 2: outputs relative to the owner folder, with sizes; 1: absolute paths, no sizes
READABLE_VERSIONS = (1, 2)
ABSENT = "absent"
_HASH_CACHE: dict[tuple, str] = {}
_commits = 0  # stage commits made by this process (`commits_made`)


class ManifestError(ValueError):
    """A stage tried to commit outputs that are not there."""


def fingerprint(path: str | os.PathLike | None) -> str:
    """sha256 of a file's bytes, or of a directory's visible files (names and contents); `ABSENT`
    when nothing is there (an optional input, e.g. no critic yet); for a path retention pruned, the
    fingerprint its tombstone recorded (agent_core/io/tombstones.py)."""
    if path is None:
        return ABSENT
    path = Path(path)
    if path.is_file():
        return _file_digest(path)
    if not path.is_dir():
        pruned = read_tombstone(path)
        return ABSENT if pruned is None else pruned.fingerprint
    digest = hashlib.sha256()
    for file in sorted(_visible_files(path)):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + _file_digest(file).encode() + b"\n")
    return "dir:" + digest.hexdigest()


def output_size(path: str | os.PathLike) -> int:
    """Bytes of a file, or of a directory's visible files (of a pruned one: as its tombstone recorded);
    -1 when nothing is there. Reads no content."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        pruned = read_tombstone(path)
        return -1 if pruned is None else pruned.bytes
    return sum(file.stat().st_size for file in _visible_files(path))


def stat_stamp(path: str | os.PathLike) -> tuple:
    """Names, inodes, sizes and modification times of a file or of a directory and its visible files;
    () when nothing is there. Reads no content, so it is cheap to check on every use: any rewrite
    (`save_policy` swaps in a new directory, `atomic_file` renames in a new file) changes it."""
    path = Path(path)
    if not path.exists():
        return ()
    entries = [path] if path.is_file() else [path, *sorted(_visible_files(path))]
    return tuple((item.relative_to(path).as_posix(), (s := item.stat()).st_ino, s.st_size, s.st_mtime_ns)
                 for item in entries)


def _visible_files(directory: Path):
    for root, dirs, files in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if not name.startswith("."):
                yield Path(root) / name


def _file_digest(path: Path) -> str:
    stat = path.stat()
    key = (str(path.resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    cached = _HASH_CACHE.get(key)
    if cached is None:
        with open(path, "rb") as handle:
            cached = hashlib.file_digest(handle, "sha256").hexdigest()
        _HASH_CACHE[key] = cached
    return cached


def params_hash(params: Mapping[str, Any]) -> str:
    """A stable hash of a stage's parameters: pydantic configs, dataclasses and plain values."""
    text = json.dumps(_plain(params), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _plain(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float) and value != value:
        return "nan"
    return value


def commits_made() -> int:
    """How many stages this process has committed: a command that committed none changed no stage's
    outputs (agent_core/io/run_status.py keeps a finished run finished when such a command fails)."""
    return _commits


@dataclass(frozen=True)
class StageManifest:
    """What one completed stage read, how it was configured, and what it wrote."""

    stage: str
    params_hash: str
    inputs: dict[str, str]  # input name -> fingerprint
    outputs: dict[str, str]  # output name -> path where it is now (stored relative: module docstring)
    output_fingerprints: dict[str, str]  # output name -> fingerprint
    # `seconds`: the stage's wall time, from its record to its commit unless the stage gave its own
    # (rollout, train); agent_core/io/ledger.py reads it
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. the stage's wall seconds
    version: int = MANIFEST_VERSION
    output_sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # output name -> bytes (format 2)


@dataclass(frozen=True)
class StageCheck:
    """Whether a stage may be skipped: its outputs (name -> path), or None and why it must run."""

    outputs: dict[str, str] | None
    reason: str = ""  # empty when complete
    damaged: tuple[str, ...] = ()  # outputs no longer as recorded ("name (path): what is wrong")


class StageRecord:
    """The manifest of one stage run: `completed()` before the work, `commit(outputs)` after it.

        record = StageRecord(path, "rollout", inputs={"prompts": uri, "policy": dir}, params={"cfg": cfg})
        if (done := record.completed()) is not None:
            return done["steps"]
        ... write the outputs ...
        record.commit({"steps": uri})
    """

    def __init__(self, path: str | os.PathLike, stage: str, inputs: Mapping[str, str | os.PathLike | None],
                 params: Mapping[str, Any]):
        self.path = Path(path)
        self.stage = stage
        self.inputs = dict(inputs)
        self.params_hash = params_hash(params)
        self._started = time.perf_counter()  # the stage's wall `seconds` run from here to commit (the ledger's)

    def completed(self) -> dict[str, str] | None:
        """The recorded outputs (name -> current path) if the stage ran with these inputs and
        parameters and its outputs are intact; None when it must run (again)."""
        return self.check().outputs

    def check(self) -> StageCheck:
        """`completed()`, saying why a stage must run: no manifest, other settings, changed inputs, or
        outputs missing or damaged since the stage committed them (`damaged`)."""
        manifest = read_manifest(self.path)
        if manifest is None or manifest.stage != self.stage:
            return StageCheck(None, "no manifest")
        if manifest.params_hash != self.params_hash:
            return StageCheck(None, "settings changed")
        current = self._input_fingerprints()
        changed = sorted(name for name in current.keys() | manifest.inputs.keys()
                         if current.get(name) != manifest.inputs.get(name))
        if changed:
            return StageCheck(None, f"inputs changed: {', '.join(changed)}")
        damaged = tuple(f"{name} ({path}): {problem}" for name, path in manifest.outputs.items()
                        if (problem := _output_problem(manifest, name, path)))
        if damaged:
            return StageCheck(None, "outputs missing or damaged", damaged)
        return StageCheck(dict(manifest.outputs))

    def commit(self, outputs: Mapping[str, str | os.PathLike], metrics: Mapping[str, float] | None = None,
               counted: bool = True) -> StageManifest:
        """Record the stage as complete; call after every output is in place. `metrics`: facts about
        this execution worth keeping with it (its wall seconds), read back by `read_manifest`.
        counted=False: not one of `commits_made` (a dataset's manifest: no run output changed)."""
        global _commits
        outputs = {name: os.fspath(path) for name, path in outputs.items()}
        missing = [f"{name} ({path})" for name, path in outputs.items() if fingerprint(path) == ABSENT]
        if missing:
            raise ManifestError(f"stage {self.stage}: cannot commit, outputs missing: {', '.join(missing)}")
        manifest = StageManifest(
            stage=self.stage, params_hash=self.params_hash, inputs=self._input_fingerprints(), outputs=outputs,
            output_fingerprints={name: fingerprint(path) for name, path in outputs.items()},
            metrics={name: float(value) for name, value in
                     {"seconds": time.perf_counter() - self._started, **(metrics or {})}.items()},
            output_sizes={name: output_size(path) for name, path in outputs.items()},
        )
        write_manifest(manifest, self.path)
        _commits += counted
        return manifest

    def _input_fingerprints(self) -> dict[str, str]:
        return {name: fingerprint(path) for name, path in sorted(self.inputs.items())}


def _output_problem(manifest: StageManifest, name: str, path: str) -> str:
    """What is wrong with a recorded output now ("" when nothing): the size first (a stat), then the hash."""
    size = output_size(path)
    if size < 0:
        return "missing"
    recorded = manifest.output_sizes.get(name)
    if recorded is not None and size != recorded:
        return f"{size} bytes, {recorded} recorded"
    if fingerprint(path) != manifest.output_fingerprints.get(name):
        return "content differs from what the stage wrote"
    return ""


def _owner(manifest_path: Path) -> Path:
    """The folder whose `_manifests/` holds the manifest: the run, iteration or dataset folder."""
    return manifest_path.parent.parent


def _stored(path: str, owner: Path) -> str:
    """An output as a manifest stores it: relative to the owner when under it, else absolute."""
    absolute = Path(os.path.abspath(path))
    for base, target in ((Path(os.path.abspath(owner)), absolute), (owner.resolve(), absolute.resolve())):
        if target.is_relative_to(base) and target != base:
            return target.relative_to(base).as_posix()
    return str(absolute)


def _located(stored: str, owner: Path, version: int) -> str:
    """A stored output as a path under the owner's current place (module docstring), in the form the
    manifest's own path has (relative to the working folder if that one is): what the stage returns
    when it runs."""
    if not os.path.isabs(stored):
        if ".." in PurePath(stored).parts:  # written relative to the owner, never climbing out: a hand edit
            raise _OutsideOwner(f"output {stored!r} climbs out of {owner}")
        return str(owner / stored)
    if version >= 2:
        return stored
    parts, anchor = PurePath(stored).parts, (owner.parent.name, owner.name)
    for start in range(len(parts) - 2, 0, -1):  # the last place the owner's two folder names appear
        if parts[start:start + 2] == anchor:
            return str(owner.joinpath(*parts[start + 2:]))
    return stored


class _OutsideOwner(ValueError):
    """A manifest's relative output path with `..`: it would name a file outside the manifest's folder."""


def read_manifest(path: str | os.PathLike) -> StageManifest | None:
    """The manifest at `path`, its outputs as paths where they are now; None if there is
    none, it is from an unknown format version, or it is damaged (written atomically, so only
    outside damage does that: redoing the stage is safe)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        version = data.get("version")
        if version not in READABLE_VERSIONS:
            return None
        manifest = StageManifest(**data)
        owner = _owner(path)
        return dataclasses.replace(manifest, outputs={name: _located(stored, owner, version)
                                                      for name, stored in manifest.outputs.items()})
    except _OutsideOwner as error:  # refused, not followed: the stage runs again and writes its own
        log.warning("manifest %s ignored: %s (a manifest records its folder's outputs relative to it); "
                    "its stage runs again", path, error)
        return None
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, AttributeError, ValueError):
        return None


def write_manifest(manifest: StageManifest, path: str | os.PathLike) -> Path:
    """Write `manifest` atomically (temporary file, fsync, rename), its outputs stored relative to
    the manifest's owner folder where they are under it."""
    owner = _owner(Path(path))
    stored = dataclasses.replace(manifest, outputs={name: _stored(output, owner)
                                                    for name, output in manifest.outputs.items()})
    with atomic_file(path, "w", failpoint_prefix=f"manifest:{manifest.stage}") as sink:
        json.dump(dataclasses.asdict(stored), sink, indent=1, sort_keys=True)
    return Path(path)
