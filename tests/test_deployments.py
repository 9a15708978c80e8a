"""prefect.yaml: every deployment's entrypoint names a Prefect flow that exists, and its parameters
are that flow's (right names, values of the right types); the example schedule is valid."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import yaml
from prefect import Flow

REPO_ROOT = Path(__file__).resolve().parent.parent


def _deployments() -> dict[str, tuple[dict, Flow]]:
    spec = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    found = {}
    for deployment in spec["deployments"]:
        path, name = deployment["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        found[deployment["name"]] = deployment, getattr(module, name)
    return found


def test_every_deployment_entrypoint_is_a_flow():
    deployments = _deployments()
    for name, (_, flow) in deployments.items():
        assert isinstance(flow, Flow), name
    assert {"train", "rerun-stage", "eval"} <= set(deployments)


def test_deployment_parameters_validate_against_their_flows():
    """A scheduled train run needs nothing more than prefect.yaml gives; eval needs only a run id."""
    needs = {"train": set(), "eval": {"run_id"}}  # what a run must be given beyond prefect.yaml
    for name, (deployment, flow) in _deployments().items():
        given = deployment.get("parameters") or {}
        signature = inspect.signature(flow.fn)
        assert set(given) <= set(signature.parameters), (name, set(given) - set(signature.parameters))
        required = {p.name for p in signature.parameters.values() if p.default is inspect.Parameter.empty}
        if name in needs:
            assert required - set(given) == needs[name], name
            validated = flow.validate_parameters({**given, **{p: "some-run-id" for p in needs[name]}})
            assert {key: validated[key] for key in given} == given, name  # each value has its parameter's type


def test_train_deployment_defaults_load_the_shipped_config():
    from agent_core.validation import load_config
    from flows.configs_lookup import resolve_config

    deployment, flow = _deployments()["train"]
    params = deployment["parameters"]
    assert flow.name == "agentr1-train-from-config" and params["overrides"] == []
    config = load_config([resolve_config(params["config"])], [f"data_root={params['data_root']}", *params["overrides"]])
    assert config.data_root == "data"


def test_the_commented_example_schedule_is_a_valid_prefect_schedule():
    from prefect.client.schemas.schedules import CronSchedule

    lines = (REPO_ROOT / "prefect.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# schedules:")
    example = ["schedules:"]
    for line in lines[start + 1:]:  # the comment lines indented below it
        body = line.strip().removeprefix("#")
        if not line.strip().startswith("#") or not body.startswith("   "):
            break
        example.append(body[1:])
    (schedule,) = yaml.safe_load("\n".join(example))["schedules"]
    assert CronSchedule(**schedule).cron == "0 3 * * *"


def test_every_deployment_sends_the_library_log_and_progress_lines_to_the_flow_run_log():
    spec = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        env = deployment["work_pool"]["job_variables"]["env"]
        assert env["PREFECT_LOGGING_EXTRA_LOGGERS"] == "agent_core", deployment["name"]
        assert env["AGENTR1_PROGRESS"] == "log", deployment["name"]
