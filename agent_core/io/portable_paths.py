"""Paths in outputs that get committed (the results page, benchmark JSON and page): no machine paths.

`portable(value, {"data root": root})` rewrites every absolute path in `value` (a string, or the
strings of a JSON-like dict/list) by the deepest folder that holds it:

- a named folder (the data root, a results folder, ...): `<data root>/runs/r1`, the folder itself `<data root>`;
- the checkout: relative to it, `data/models/smollm2` (the checkout itself `.`);
- the home folder: `~/...`; the system's temporary folder: `<tmp>/...` (what is left of a scratch path).

Paths are found inside free text too: command lines (`--data-root /tmp/x`, `--set policy.path=/tmp/x/p`),
markdown, URIs (`file:///tmp/x/a`). A folder's path is matched as given (made absolute) and resolved
(symlinks, e.g. /tmp -> /private/tmp), and only whole path components (`/tmp/ab` never matches `/tmp/abc`).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

CHECKOUT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
_PATH_CHAR = r"[\w.~-]"


def _forms(folder: str | Path) -> set[str]:
    """The absolute spellings of `folder`: as given (made absolute) and resolved; never `/` alone."""
    given = os.path.abspath(os.path.expanduser(str(folder)))
    return {form for form in (given, os.path.realpath(given)) if form.strip("/")}


def _replacements(named: Mapping[str, str | Path | None]) -> dict[str, tuple[str, str]]:
    """Absolute folder -> (what the folder itself becomes, what its `folder/` prefix becomes)."""
    table: dict[str, tuple[str, str]] = {}
    fallbacks = [(Path.home(), ("~", "~/")), (tempfile.gettempdir(), ("<tmp>", "<tmp>/")), (CHECKOUT, (".", ""))]
    for folder, forms in [*fallbacks, *((f, (f"<{label}>", f"<{label}>/")) for label, f in named.items() if f)]:
        for form in _forms(folder):
            table[form] = forms  # named folders come last: they win over a fallback with the same path
    return table


def portable(value: T, named: Mapping[str, str | Path | None] | None = None) -> T:
    """`value` with every absolute path under a named folder, the checkout, home or the temporary
    folder rewritten (module doc); strings inside dicts, lists and tuples too; anything else unchanged."""
    table = _replacements(named or {})
    # longest first: at one position the deepest folder that matches wins
    alternatives = "|".join(re.escape(form) for form in sorted(table, key=len, reverse=True))
    pattern = re.compile(rf"(?<!{_PATH_CHAR})({alternatives})(?:(/)|(?![\w.~/-]))")

    def rewrite(match: re.Match) -> str:
        itself, prefix = table[match.group(1)]
        return prefix if match.group(2) else itself

    def walk(item):
        if isinstance(item, str):
            return pattern.sub(rewrite, item)
        if isinstance(item, dict):
            return {walk(k): walk(v) for k, v in item.items()}
        if isinstance(item, (list, tuple)):
            return type(item)(walk(v) for v in item)
        return item

    return walk(value)
