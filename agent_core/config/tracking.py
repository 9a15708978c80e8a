"""The `tracking:` section: MLflow tracking and the registered model."""

from __future__ import annotations

from pydantic import Field

from agent_core.config._base import Section


class TrackingConfig(Section):
    """MLflow tracking: where runs are logged, the experiment, and the registered model each
    iteration's checkpoint becomes a version of (tasks/track.py)."""

    tracking_uri: str | None = Field(None, description="default: sqlite database in the data root")
    experiment: str = Field("agentr1", description="MLflow experiment the run is logged under; one per study, so "
                            "its runs compare side by side")
    model_name: str | None = Field(
        None, pattern=r"^[^'/@]+$",
        description="registered model each iteration's checkpoint becomes a version of (a loadable MLflow model; "
        "aliases `latest` and `best`); default: '<experiment>-policy', one model per experiment")
    register_every: int = Field(
        1, ge=1, description="register every N-th iteration's checkpoint as a model version, and always the last one "
        "and any whose dev EM reaches the model's best (so `best` is the same checkpoint as with 1)")
    traces: int = Field(
        0, ge=0, le=100, description="episodes per iteration logged as MLflow traces (MLflow's Traces tab: a span per "
        "step with its action, observation, reward and advantage), spread from the worst reward to the best; 0: none")

    def registered_model_name(self) -> str:
        return self.model_name or f"{self.experiment}-policy"
