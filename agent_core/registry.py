"""Name -> implementation registries for every swappable part (engines, envs, rewards, estimators).

A config names a part by string; a misspelt name fails with the list of valid names, so it can be
checked at config-load time rather than mid-run.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Generic, Mapping, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError, ValueError):
    """Raised for a name that is not registered; the message lists the valid names.

    A ValueError too, so pydantic validators turn it into a config validation error.
    """

    def __init__(self, kind: str, name: str, valid: list[str]):
        self.kind, self.name, self.valid = kind, name, valid
        super().__init__(f"unknown {kind} {name!r}; valid {kind} names: {', '.join(valid) or '(none)'}")

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return self.args[0]


class Registry(Generic[T]):
    """A named collection of implementations of one kind.

    >>> ESTIMATORS = Registry("advantage estimator")
    >>> @ESTIMATORS.register("grpo")
    ... def grpo(...): ...
    """

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}
        self._settings: dict[str, Any] = {}
        self._traits: dict[str, Any] = {}

    def register(self, name: str, *, settings: Any = None, traits: Any = None) -> Callable[[T], T]:
        """Register under `name`. settings: the model of the item's own settings (a pydantic model
        class: `model_validate` of the config's options section builds the object the item gets).
        traits: what callers must know of the item without building it (an env's `EnvTraits`, an
        engine's `EngineTraits`), read back with `traits`."""
        def decorator(item: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._items[name] = item
            for table, value in ((self._settings, settings), (self._traits, traits)):
                if value is not None:
                    table[name] = value
            return item

        return decorator

    def traits(self, name: str, default: Any = None) -> Any:
        """The traits `name` was registered with, else `default` (UnknownNameError for an unknown name)."""
        self.get(name)
        return self._traits.get(name, default)

    @contextmanager
    def scoped(self) -> Iterator[None]:
        """Registrations made inside the block are undone when it ends (a test's plugin, a notebook's
        experiment); what was registered before stays."""
        saved = [(table, dict(table)) for table in (self._items, self._settings, self._traits)]
        try:
            yield
        finally:
            for table, before in saved:
                table.clear()
                table.update(before)

    def settings_model(self, name: str) -> Any:
        """The settings model `name` was registered with; None if it takes no options."""
        self.get(name)
        return self._settings.get(name)

    def settings(self, name: str, options: Mapping[str, Any]) -> Any:
        """`name`'s settings object built from `options` (None when it takes none and `options` is
        empty); ValueError naming the item when options are given to one without a settings model,
        pydantic's ValidationError (a ValueError) when they do not fit its model."""
        model = self.settings_model(name)
        if model is None:
            if options:
                raise ValueError(f"{self.kind} {name!r} takes no options (it was registered without a settings "
                                 f"model); got {', '.join(map(repr, sorted(options)))}")
            return None
        return model.model_validate(dict(options))

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.names()) from None

    def check(self, name: str) -> str:
        """Return `name` if registered, else raise UnknownNameError (for config validators)."""
        self.get(name)
        return name

    def names(self) -> list[str]:
        return sorted(self._items)

    def kwarg_names(self, name: str, skip: int = 1) -> list[str]:
        """The keyword arguments factory `name` accepts, after its first `skip` parameters
        (e.g. the shared resources an env or tool factory receives)."""
        parameters = list(inspect.signature(self.get(name)).parameters.values())[skip:]
        return [p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def check_kwargs(self, name: str, kwargs: Mapping[str, Any], skip: int = 1) -> None:
        """TypeError naming the item, the bad keys and the valid ones if `kwargs` has a key it does not take."""
        valid = self.kwarg_names(name, skip)
        unexpected = sorted(set(kwargs) - set(valid))
        if unexpected:
            raise TypeError(
                f"{self.kind} {name!r} got unexpected argument(s) {', '.join(map(repr, unexpected))}; "
                f"valid arguments: {', '.join(valid) or '(none)'}"
            )

    def __contains__(self, name: object) -> bool:
        return name in self._items
