"""What every config section shares: frozen, unknown keys refused, floats finite (nan and infinities
refused alike; a key that means something by .inf says so with its own Field(allow_inf_nan=True))."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, PlainValidator


class Section(BaseModel):
    """A config section (the experiment definition's too): frozen, unknown keys refused, floats finite."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


def int_or_auto(minimum: int) -> PlainValidator:
    """An integer >= minimum or "auto", with one message (a plain union would give two)."""
    def check(value: Any) -> int | str:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
            return value
        raise ValueError(f"got {value!r}; it must be an integer >= {minimum} or auto")
    return PlainValidator(check)
