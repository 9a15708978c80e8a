"""Stage manifests: when a stage's outputs are complete, and when a rerun may reuse them.

A stage writes each output atomically (tables: `tables.write_table`; checkpoints: `save_policy`),
then, last of all and also atomically, its manifest: a small JSON file naming the stage, a hash of
its parameters (the config sections and numbers it was called with), a fingerprint of every input
and every output. The manifest is the commit record: a crash before it leaves the stage
incomplete, whatever outputs already exist, and a rerun redoes the stage.

A rerun of a flow skips a stage when its manifest exists, the parameter hash and input
fingerprints equal the current ones, and every output still has its recorded fingerprint (so an
output deleted or edited by hand is rebuilt). A changed config section or a changed input table
reruns the stage, and since its outputs then change, everything downstream reruns too.

Fingerprints are SHA-256 over content, not modification times: a redone stage whose outputs come
out byte-identical (a deterministic run) lets its downstream stages be skipped. Directories
(checkpoints) hash their files' names and contents; hidden names (`.x.tmp-...`, leftovers of a
killed writer) are ignored. Hashes are cached per (path, inode, size, mtime) within a process, so a
checkpoint read by several stages is hashed once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_core.io.atomic import atomic_file

MANIFEST_VERSION = 1
ABSENT = "absent"
_HASH_CACHE: dict[tuple, str] = {}


class ManifestError(ValueError):
    """A stage tried to commit outputs that are not there."""


def fingerprint(path: str | os.PathLike | None) -> str:
    """sha256 of a file's bytes, or of a directory's visible files (names and contents); `ABSENT`
    when nothing is there (an optional input, e.g. no critic yet)."""
    if path is None:
        return ABSENT
    path = Path(path)
    if path.is_file():
        return _file_digest(path)
    if not path.is_dir():
        return ABSENT
    digest = hashlib.sha256()
    for file in sorted(_visible_files(path)):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + _file_digest(file).encode() + b"\n")
    return "dir:" + digest.hexdigest()


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


@dataclass(frozen=True)
class StageManifest:
    """What one completed stage read, how it was configured, and what it wrote."""

    stage: str
    params_hash: str
    inputs: dict[str, str]  # input name -> fingerprint
    outputs: dict[str, str]  # output name -> path
    output_fingerprints: dict[str, str]  # output name -> fingerprint
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # e.g. the stage's wall seconds
    version: int = MANIFEST_VERSION


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

    def completed(self) -> dict[str, str] | None:
        """The recorded outputs (name -> path) if the stage ran with these inputs and parameters and
        its outputs are intact; None when it must run (again)."""
        manifest = read_manifest(self.path)
        if manifest is None or manifest.stage != self.stage or manifest.params_hash != self.params_hash:
            return None
        if manifest.inputs != self._input_fingerprints():
            return None
        for name, output in manifest.outputs.items():
            if fingerprint(output) != manifest.output_fingerprints.get(name):
                return None
        return dict(manifest.outputs)

    def commit(self, outputs: Mapping[str, str | os.PathLike], metrics: Mapping[str, float] | None = None) -> StageManifest:
        """Record the stage as complete; call after every output is in place. `metrics`: facts about
        this execution worth keeping with it (its wall seconds), read back by `read_manifest`."""
        outputs = {name: os.fspath(path) for name, path in outputs.items()}
        missing = [f"{name} ({path})" for name, path in outputs.items() if fingerprint(path) == ABSENT]
        if missing:
            raise ManifestError(f"stage {self.stage}: cannot commit, outputs missing: {', '.join(missing)}")
        manifest = StageManifest(
            stage=self.stage, params_hash=self.params_hash, inputs=self._input_fingerprints(), outputs=outputs,
            output_fingerprints={name: fingerprint(path) for name, path in outputs.items()},
            metrics={name: float(value) for name, value in (metrics or {}).items()},
        )
        write_manifest(manifest, self.path)
        return manifest

    def _input_fingerprints(self) -> dict[str, str]:
        return {name: fingerprint(path) for name, path in sorted(self.inputs.items())}


def read_manifest(path: str | os.PathLike) -> StageManifest | None:
    """The manifest at `path`; None if there is none, it is from another format version, or it is
    damaged (written atomically, so only outside damage does that: redoing the stage is safe)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("version") != MANIFEST_VERSION:
            return None
        return StageManifest(**data)
    except (json.JSONDecodeError, TypeError, AttributeError):
        return None


def write_manifest(manifest: StageManifest, path: str | os.PathLike) -> Path:
    """Write `manifest` atomically (temporary file, fsync, rename)."""
    with atomic_file(path, "w", failpoint_prefix=f"manifest:{manifest.stage}") as sink:
        json.dump(dataclasses.asdict(manifest), sink, indent=1, sort_keys=True)
    return Path(path)
