"""The wheel: what it ships, and `agentr1 train --config tiny` from an install outside the checkout.

The wheel is built from a copy of the sources that pyproject.toml packages (a build in the checkout
would leave build/ there, whose stale files could end up in later wheels), with the pipeline's own
setuptools and no download (`--no-build-isolation`). It is installed with `pip install --no-deps
--target`: a folder on PYTHONPATH over this environment, whose dependencies (torch, ...) it uses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from agent_core.io.layout import RUN_TABLES, DataRoot

REPO_ROOT = Path(__file__).resolve().parent.parent
# What the build reads: pyproject.toml, the readme it names, the packages and the configs folder.
BUILD_INPUTS = ("pyproject.toml", "README.md", "agent_core", "schemas", "tasks", "flows", "configs")
PACKAGES = ("agent_core", "schemas", "tasks", "flows")
IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".*")


def _pip(*args: str, timeout: float = 300) -> None:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    for name in BUILD_INPUTS:
        origin = REPO_ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=IGNORED)
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(origin, source / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "--quiet", "-w", str(root / "dist"), str(source))
    (built,) = (root / "dist").glob("agentr1_pipeline-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    _pip("install", "--no-deps", "--no-index", "--no-compile", "--quiet", "--target", str(target), str(wheel))
    return target


def test_the_wheel_ships_every_module_and_every_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {path.relative_to(REPO_ROOT).as_posix() for package in PACKAGES
                for path in (REPO_ROOT / package).rglob("*.py") if "__pycache__" not in path.parts}
    missing = sorted(expected - names)
    assert not missing, ("the wheel lacks these modules: add their packages to [tool.setuptools] packages in "
                         f"pyproject.toml: {missing}")
    configs = {f"flows/configs/{path.relative_to(REPO_ROOT / 'configs').as_posix()}"
               for path in (REPO_ROOT / "configs").rglob("*.yaml")}
    assert {"flows/configs/tiny.yaml", "flows/configs/demo.yaml", "flows/configs/algos/ppo.yaml"} <= configs
    assert configs <= names, sorted(configs - names)
    templates = {path.relative_to(REPO_ROOT).as_posix() for path in (REPO_ROOT / "agent_core/viewer").rglob("*.html")}
    assert "agent_core/viewer/templates/episode.html" in templates and templates <= names, sorted(templates - names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "agentr1 = flows.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_config_names_resolve_to_the_shipped_configs(tmp_path, monkeypatch, capsys):
    """In the checkout (editable install) the shipped configs are configs/; a file of the name wins."""
    from flows.cli import main, resolve_config, shipped_configs

    monkeypatch.chdir(tmp_path)
    assert shipped_configs()["algos/ppo"] == REPO_ROOT / "configs" / "algos" / "ppo.yaml"
    for name in ("tiny", "tiny.yaml", "configs/tiny.yaml"):
        assert resolve_config(name) == str(REPO_ROOT / "configs" / "tiny.yaml")
    assert "using the shipped config 'tiny'" in capsys.readouterr().out
    (tmp_path / "tiny").write_text("iterations: 1\n")
    assert resolve_config("tiny") == "tiny"
    assert resolve_config("elsewhere/missing.yaml") == "elsewhere/missing.yaml"  # the loader names the missing file
    with pytest.raises(FileNotFoundError, match=r"no shipped config of that name; shipped: .*algos/ppo.*tiny"):
        resolve_config("tinyy")
    assert main(["train", "--config", "tinyy", "--data-root", str(tmp_path / "data")]) == 2
    assert main(["configs"]) == 0
    listing = capsys.readouterr().out
    assert f"{REPO_ROOT / 'configs' / 'demo.yaml'}" in listing and "A seconds-long run" in listing


def _outside_env(installed: Path, home: Path, prefect_api: str | None = None) -> dict[str, str]:
    """The environment of a user's shell: the installed wheel on PYTHONPATH, nothing of the checkout,
    no Prefect or agentr1 settings of this test session (but `prefect_api`, if given)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "AGENTR1_", "MLFLOW_")) and k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PYTHONPATH=str(installed), HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_TO_API_ENABLED="false")
    if prefect_api:
        env["PREFECT_API_URL"] = prefect_api
    return env


def test_the_installed_package_lists_its_shipped_configs(installed, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = _outside_env(installed, tmp_path)
    probe = subprocess.run(
        [sys.executable, "-c", "import agent_core, flows.cli, schemas, tasks, sys; "
                               "print('\\n'.join(m.__file__ for m in (agent_core, flows.cli, schemas, tasks)))"],
        cwd=outside, env=env, capture_output=True, text=True, timeout=120)
    assert probe.returncode == 0, probe.stderr
    for path in probe.stdout.split():
        assert Path(path).resolve().is_relative_to(installed.resolve()), f"{path} is not from the wheel install"
    listing = subprocess.run([str(installed / "bin" / "agentr1"), "configs"], cwd=outside, env=env,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stdout + listing.stderr
    assert f"{installed / 'flows' / 'configs' / 'tiny.yaml'}" in listing.stdout
    assert f"{installed / 'flows' / 'configs' / 'algos' / 'ppo.yaml'}" in listing.stdout
    shown = subprocess.run([str(installed / "bin" / "agentr1"), "--version"], cwd=outside, env=env,
                           capture_output=True, text=True, timeout=120)
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert shown.returncode == 0 and shown.stdout.strip() == f"agentr1 {declared}", shown.stdout + shown.stderr


@pytest.mark.slow
def test_agentr1_train_with_a_shipped_config_runs_outside_the_checkout(installed, tmp_path):
    """`agentr1 train --config tiny` (the shipped configs/tiny.yaml) from a folder outside the checkout,
    its MLflow store under the data root, as a user of the wheel would run it. Prefect's API is this
    test session's (as in kill_harness.run_cli): a temporary one of its own costs ~20 s to start."""
    from kill_harness import prefect_api_url

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    data_root = outside / "data"
    command = [str(installed / "bin" / "agentr1"), "train", "--config", "tiny", "--run-id", "wheel",
               "--data-root", "data", "--set", "iterations=1", "--set", "dev_eval.every=0"]
    done = subprocess.run(command, cwd=outside, env=_outside_env(installed, tmp_path, prefect_api_url()),
                          capture_output=True, text=True, timeout=500)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert f"using the shipped config 'tiny' ({installed / 'flows' / 'configs' / 'tiny.yaml'})" in output, output[-3000:]
    run = DataRoot(data_root).run("wheel")
    for table in RUN_TABLES:
        assert Path(run.table_uri(0, table)).is_file(), table
    assert (run.checkpoint_dir(0) / "model.safetensors").is_file()
    assert not (REPO_ROOT / "data" / "runs" / "wheel").exists()
