"""`agentr1 query`: one SELECT over every table of every run under a data root (agent_core/io/query.py),
printed as a table or written with --output. Bad input (not one SELECT, a bad --timeout or
--memory-limit, an --output that would overwrite something) fails in one line before DuckDB opens."""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path


def query_command(args: argparse.Namespace, data_root: Path) -> int:
    from agent_core.io.query import (IgnoredFileWarning, QueryInterrupted, check_result_path, check_select,
                                     format_table, has_tables, run_query, write_result)
    from agent_core.io.readonly_sql import check_memory_limit

    check_select(args.sql)  # a statement that is not one SELECT is refused whatever the data root holds
    timeout = query_timeout(args.timeout)
    if args.memory_limit is not None:
        try:
            check_memory_limit(args.memory_limit)
        except ValueError as error:
            raise ValueError(f"--memory-limit: {error}") from None
    if args.output:
        check_result_path(Path(args.output), data_root, force=args.force)
    with warnings.catch_warnings(record=True) as ignored:  # a stray file in a run: one line each, once
        warnings.simplefilter("always", IgnoredFileWarning)
        try:
            if not has_tables(data_root):
                raise FileNotFoundError(f"no tables under {data_root}: no run, dataset or eval has written any yet "
                                        "(start one with `agentr1 train`, or point --data-root at an existing one)")
            table = run_query(data_root, args.sql, timeout=timeout, memory_limit=args.memory_limit)
        except QueryInterrupted as error:
            raise ValueError(f"{error} (--timeout {args.timeout}: raise it or leave it out)") from None
        finally:
            for message in dict.fromkeys(str(w.message) for w in ignored if w.category is IgnoredFileWarning):
                print(f"agentr1: warning: {message}", file=sys.stderr)
    if args.output:
        write_result(table, Path(args.output))
        print(f"agentr1: wrote {table.num_rows} rows to {args.output}")
    else:
        print(format_table(table, max_rows=args.max_rows))
    return 0


def query_timeout(text: str | None) -> float | None:
    """`--timeout` as seconds (a positive number), None when not given; ValueError in one line."""
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"--timeout must be a positive number of seconds, not {text!r}")
    return seconds
