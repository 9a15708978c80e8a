"""prefect.yaml: every deployment's entrypoint names a Prefect flow that exists."""

from __future__ import annotations

import importlib
from pathlib import Path

import yaml
from prefect import Flow

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_every_deployment_entrypoint_is_a_flow():
    spec = yaml.safe_load((REPO_ROOT / "prefect.yaml").read_text())
    names = []
    for deployment in spec["deployments"]:
        path, name = deployment["entrypoint"].split(":")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        assert isinstance(getattr(module, name), Flow), deployment["name"]
        names.append(deployment["name"])
    assert {"train", "rerun-stage", "eval"} <= set(names)
