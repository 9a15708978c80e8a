"""YAML text to plain values, bounded: the one loader of every YAML the project reads (config files,
`--set` values, `audit --checks`, a run's config.yaml for `agentr1 runs`, experiment files).

PyYAML's safe loader shares an aliased value, so a 1 KB file of nested aliases loads at once, and
every copy, check or validation after it walks the expansion: billions of values (8 GB, minutes).
Here the document is bounded while it is composed, before any value is built: the values it
expands to (an alias counts as all of its value), the nesting depth (PyYAML recurses per level) and
the digits of a number (Python refuses to convert more than 4,300; none is a real setting). Each
refusal is one line naming the source, the key, the line and the column.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.error import Mark
from yaml.events import AliasEvent, MappingStartEvent, SequenceStartEvent
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

MAX_VALUES = 100_000  # values a document expands to; the largest real config is ~300
MAX_DEPTH = 64  # levels of lists and mappings; the deepest real config is a few
MAX_DIGITS = 100  # characters of a number; a float's exact decimal is ~20
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")


class YamlLimitError(ValueError):
    """A YAML document past one of the bounds (module docstring); the message is one line."""


def load_yaml(text: str, source: str) -> Any:
    """The value of the YAML document `text` (None when empty), read like `yaml.safe_load`; a document
    past a bound raises YamlLimitError naming `source`, a malformed one yaml.YAMLError as PyYAML does."""
    if _CLoader is not None:
        try:
            return _load(_CLoader, text, source)
        except yaml.YAMLError:  # read again by PyYAML: its words for the error (and its reading, where they differ)
            pass
    return _load(_PyLoader, text, source)


def _load(loader_class: type, text: str, source: str) -> Any:
    loader = loader_class(text, source)
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as error:
        if error.problem == "exceeded maximum nesting depth":  # libyaml's own bound, 1,000 levels: it reads ahead
            loader.refuse_too_deep(error.problem_mark)
        raise
    finally:
        loader.dispose()


class _BoundedComposer(Composer):
    """PyYAML's composer, counting as it composes: each node's expanded size and the key path to it."""

    def __init__(self, source: str):
        super().__init__()
        self._source, self._sizes, self._path = source, {}, []

    def compose_node(self, parent: Node | None, index: Any) -> Node:
        mark = self.peek_event().start_mark
        if isinstance(index, Node):  # a mapping's value: index is its key
            self._path.append(f".{index.value}" if isinstance(index, ScalarNode) else ".?")
        else:  # a list's item (its position), the document or a mapping's key (None)
            self._path.append(f"[{index}]" if isinstance(index, int) else "")
        alias = self.check_event(AliasEvent)
        if len(self._path) > MAX_DEPTH and self.check_event(SequenceStartEvent, MappingStartEvent):
            self.refuse_too_deep(mark)
        node = super().compose_node(parent, index)
        if alias and id(node) not in self._sizes:  # the anchor's value is still being composed
            self._refuse("an alias refers to a value that contains it (it never ends)", mark)
        if not alias:  # ids are unique: every node lives until the document is built
            children = (node.value if isinstance(node, SequenceNode) else
                        [child for pair in node.value for child in pair] if isinstance(node, MappingNode) else [])
            self._sizes[id(node)] = 1 + sum(self._sizes[id(child)] for child in children)
        if self._sizes[id(node)] > MAX_VALUES:
            self._refuse(f"its aliases expand to more than {MAX_VALUES:,} values", mark)
        if isinstance(node, ScalarNode) and node.tag in _NUMBER_TAGS and len(node.value) > MAX_DIGITS:
            self._refuse(f"a number {len(node.value):,} characters long, more than {MAX_DIGITS}", mark)
        self._path.pop()
        return node

    def refuse_too_deep(self, mark: Mark) -> None:
        self._refuse(f"a value is nested more than {MAX_DEPTH} levels deep", mark)

    def _refuse(self, problem: str, mark: Mark) -> None:
        parts = [part for part in self._path if part]
        key = "".join(parts if len(parts) <= 4 else [*parts[:3], "...", parts[-1]]).lstrip(".")
        where = f"at {key}, " if key else ""
        raise YamlLimitError(f"{self._source}: {problem} ({where}line {mark.line + 1} column {mark.column + 1})")


class _PyLoader(_BoundedComposer, Reader, Scanner, Parser, SafeConstructor, Resolver):
    def __init__(self, text: str, source: str):
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        _BoundedComposer.__init__(self, source)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)

    def fetch_flow_collection_start(self, TokenClass: type) -> None:  # noqa: N803 (PyYAML's name)
        # PyYAML's scanner reads a flow collection ahead of the composer, in time quadratic in its depth
        if self.flow_level >= MAX_DEPTH:
            self.refuse_too_deep(self.get_mark())
        super().fetch_flow_collection_start(TokenClass)


try:  # libyaml's parser where installed: ~4x faster than PyYAML's (the 50 configs `agentr1 runs` reads)
    from yaml.cyaml import CParser
except ImportError:
    _CLoader = None
else:
    class _CLoader(_BoundedComposer, CParser, SafeConstructor, Resolver):
        def __init__(self, text: str, source: str):
            CParser.__init__(self, text)
            _BoundedComposer.__init__(self, source)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)
