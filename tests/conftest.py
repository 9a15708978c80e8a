"""Test-session environment: Prefect and MLflow state in a throwaway directory, nothing global.

Set before any test module imports prefect (it reads its settings at import).
"""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="agentr1-tests-"))
os.environ["PREFECT_HOME"] = str(_SESSION_DIR / "prefect")
os.environ.pop("PREFECT_API_URL", None)  # never talk to a user's server from tests
# Flow logs stay on the console: shipping them to the temporary API races its shutdown at exit.
os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"

from flows.environment import configure_environment  # noqa: E402

configure_environment(_SESSION_DIR)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_server(monkeypatch):
    """Fail the test if a command got as far as configuring Prefect or starting its server: early
    errors must come before either (tests/test_early_errors.py, tests/test_device_placement.py)."""
    from flows import cli

    def started(*args, **kwargs):
        raise AssertionError("the command went on to Prefect before rejecting its input")
    monkeypatch.setattr(cli, "configure_environment", started)
    monkeypatch.setattr(cli, "start_temporary_server", started)


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A folder of the user's own, made the current directory and importable: where a config's
    `plugins:` modules are found (agent_core/plugins.py). What its plugins register is undone after
    the test (`Registry.scoped`) and their modules forgotten, so other tests see the built-ins only."""
    folder = tmp_path / "user"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    modules = set(sys.modules)
    with ExitStack() as scopes:
        for registry in _registries():
            scopes.enter_context(registry.scoped())
        yield folder
    for name in set(sys.modules) - modules:
        if str(getattr(sys.modules[name], "__file__", "") or "").startswith(str(folder)):
            del sys.modules[name]


def _registries() -> list:
    from agent_core.algos.estimator_core import ADVANTAGE_ESTIMATORS
    from agent_core.algos.kl import KL_ESTIMATORS
    from agent_core.algos.losses import LOSS_AGG_MODES, POLICY_LOSSES
    from agent_core.drivers import DRIVERS
    from agent_core.envs.formats.actions import FORMATS
    from agent_core.envs.registry import ENVS
    from agent_core.envs.tools import TOOLS
    from agent_core.eval.methods import EVAL_METHODS
    from agent_core.rewards.scorers import SCORERS
    from agent_core.rollout.engines import ENGINES
    from agent_core.training.objectives import TRAINING_OBJECTIVES

    return [ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES, DRIVERS, FORMATS, ENVS, TOOLS,
            EVAL_METHODS, SCORERS, ENGINES, TRAINING_OBJECTIVES]


def pytest_unconfigure(config):
    """Stop Prefect's temporary API server while pytest's streams are still open (its own atexit
    hook would log to a closed stream)."""
    import sys

    server_module = sys.modules.get("prefect.server.api.server")
    if server_module is not None:
        for server in list(server_module.SubprocessASGIServer._instances.values()):
            server.stop()
