"""The paper-style results table from `eval` rows: EM and F1 per method x data source, mean ± std
over seeds, plus an average over data sources.

Order of aggregation (as in papers that report several seeds): each seed's score is its mean over
prompts; the cell is the mean and sample standard deviation (ddof=1; 0 for a single seed) of those
per-seed scores. The average column averages, per seed, that seed's per-source scores (each data
source counts once, whatever its size), then takes mean ± std across seeds the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pyarrow as pa

AVERAGE = "average"
METRICS = ("em", "f1")
_REQUIRED_COLUMNS = ("method", "data_source", "seed", "em", "f1")


@dataclass(frozen=True)
class MeanStd:
    mean: float
    std: float
    seeds: int

    @classmethod
    def of(cls, per_seed: Sequence[float]) -> "MeanStd":
        if not per_seed:
            raise ValueError("MeanStd needs at least one per-seed score")
        std = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
        return cls(statistics.fmean(per_seed), std, len(per_seed))

    def cell(self, digits: int = 3) -> str:
        return f"{self.mean:.{digits}f} ± {self.std:.{digits}f}"


@dataclass(frozen=True)
class ScoreCell:
    """One method on one data source (or AVERAGE): EM and F1 over seeds."""

    method: str
    data_source: str
    em: MeanStd
    f1: MeanStd


@dataclass(frozen=True)
class EvalReport:
    """methods: in the order they first appear; data_sources: sorted (AVERAGE not included)."""

    methods: tuple[str, ...]
    data_sources: tuple[str, ...]
    cells: tuple[ScoreCell, ...]

    def cell(self, method: str, data_source: str) -> ScoreCell | None:
        return next((c for c in self.cells if c.method == method and c.data_source == data_source), None)

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: eval/<method>/<source>/<em|f1> (the mean) and .../<em|f1>_std."""
        metrics: dict[str, float] = {}
        for c in self.cells:
            for name in METRICS:
                score: MeanStd = getattr(c, name)
                metrics[f"eval/{c.method}/{c.data_source}/{name}"] = score.mean
                metrics[f"eval/{c.method}/{c.data_source}/{name}_std"] = score.std
        return metrics

    def markdown(self, digits: int = 3) -> str:
        """One table per metric: rows = methods, columns = data sources + Avg, cells "mean ± std"."""
        sections = [self._metric_table(name, digits) for name in METRICS]
        return "\n\n".join(sections) + "\n"

    def _metric_table(self, metric: str, digits: int) -> str:
        columns = (*self.data_sources, AVERAGE)
        header = ["Method", "Seeds", *self.data_sources, "Avg"]
        lines = [f"### {metric.upper()} (mean ± std over seeds)", "", _row(header), _row(["---"] * len(header))]
        for method in self.methods:
            seeds = self.cell(method, AVERAGE).em.seeds
            cells = [self.cell(method, source) for source in columns]
            lines.append(_row([method, str(seeds), *("–" if c is None else getattr(c, metric).cell(digits) for c in cells)]))
        return "\n".join(lines)


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def eval_report(table: pa.Table) -> EvalReport:
    """The report of an `eval` table (or any table with method, data_source, seed, em, f1)."""
    missing = [c for c in _REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise ValueError(f"eval report: the table lacks column(s) {', '.join(missing)}; it needs {', '.join(_REQUIRED_COLUMNS)}")
    if table.num_rows == 0:
        raise ValueError("eval report: the eval table has no rows")
    # (method, source, seed) -> per-prompt scores; the table holds one row per episode (small).
    scores: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for row in table.select(list(_REQUIRED_COLUMNS)).to_pylist():
        scores.setdefault((row["method"], row["data_source"], row["seed"]), []).append((row["em"], row["f1"]))
    methods = tuple(dict.fromkeys(method for method, _, _ in scores))
    sources = tuple(sorted({source for _, source, _ in scores}))
    cells = []
    for method in methods:
        per_source = {  # source -> seed -> (em, f1) mean over prompts
            source: {seed: _means(rows) for (m, s, seed), rows in sorted(scores.items()) if m == method and s == source}
            for source in sources
        }
        for source, by_seed in per_source.items():
            if by_seed:
                cells.append(_cell(method, source, list(by_seed.values())))
        seeds = sorted({seed for by_seed in per_source.values() for seed in by_seed})
        averages = [_means([by_seed[seed] for by_seed in per_source.values() if seed in by_seed]) for seed in seeds]
        cells.append(_cell(method, AVERAGE, averages))
    return EvalReport(methods, sources, tuple(cells))


def _means(pairs: Sequence[tuple[float, float]]) -> tuple[float, float]:
    return statistics.fmean(p[0] for p in pairs), statistics.fmean(p[1] for p in pairs)


def _cell(method: str, source: str, per_seed: Sequence[tuple[float, float]]) -> ScoreCell:
    return ScoreCell(method, source, MeanStd.of([p[0] for p in per_seed]), MeanStd.of([p[1] for p in per_seed]))
