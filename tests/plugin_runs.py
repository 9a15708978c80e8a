"""A tiny training run with a plugin of the user's own (the plugin tests of issue 40 share it)."""

from __future__ import annotations

from pathlib import Path

from agent_core.io.layout import DataRoot, RunLayout
from flows.cli import main as cli_main


def write_plugin(folder: Path, module: str, text: str) -> Path:
    """`text` as the user's module `module` in `folder` (the `user_folder` fixture: importable, undone after)."""
    (folder / f"{module}.py").write_text(text)
    return folder


def train_tiny(root: Path, plugin: str, *settings: str, run_id: str = "a") -> RunLayout:
    """`agentr1 train --config tiny` for one iteration with `plugins=[plugin]` and each `--set` of
    `settings`; the run's layout (the command must succeed)."""
    sets = [arg for setting in ("iterations=1", f"plugins=[{plugin}]", *settings) for arg in ("--set", setting)]
    assert cli_main(["train", "--config", "tiny", "--run-id", run_id, "--data-root", str(root), *sets]) == 0
    return DataRoot(root).run(run_id)
