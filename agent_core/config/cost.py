"""The `cost:` section of a run's config: what one device-hour costs, so the `costs` view can put a
price on a run (agent_core/io/ledger.py). Unset prices stay null in every cost column, never zero:
a run with no price set has an unknown cost, not a free one.

Its own module of the config package, like every section (agent_core/config/pipeline.py adds the field).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class CostConfig(BaseModel):
    """Prices per device-hour. A stage's device-hours are its wall hours times the devices the run
    held (GPUs where the run's device is CUDA, else the CPU cores this process may use)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    per_gpu_hour: float | None = Field(
        None, ge=0, description="price of one GPU for one hour, applied to runs whose device is cuda; "
        "unset: their cost is null")
    per_cpu_hour: float | None = Field(
        None, ge=0, description="price of one CPU core for one hour, applied to runs whose device is cpu; "
        "unset: their cost is null")
    currency: str = Field("USD", min_length=1, max_length=16,
                          description="label of the prices' currency, copied into the ledger and the costs view")

    def price_per_hour(self, device: str) -> float | None:
        """The price of one hour of one device of kind `device` ("cuda" or "cpu"), None when unset."""
        return self.per_gpu_hour if device == "cuda" else self.per_cpu_hour
