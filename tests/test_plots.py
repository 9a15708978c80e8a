"""The report plots: learning curves have integer iteration ticks and keep every series visible even
where curves coincide (each its own marker, style and offset); files are written."""

from __future__ import annotations

import agent_core.io.plots as plots


def _captured(monkeypatch):
    figures = []

    def keep(figure, path):
        figures.append(figure)
        return path

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def test_curves_have_integer_ticks_and_no_series_hides_another(monkeypatch, tmp_path):
    figures = _captured(monkeypatch)
    same = [(0, 0.1), (1, 0.2), (2, 0.3)]  # three arms with identical curves
    plots.plot_curves({"a": same, "b": same, "c": same, "empty": []}, title="t", ylabel="y", path=tmp_path / "x.png")
    (axis,) = figures[0].axes
    figures[0].canvas.draw()
    ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    lines = axis.get_lines()
    assert len(lines) == 3  # the empty series draws nothing
    assert len({tuple(line.get_xdata()) for line in lines}) == 3  # offsets: no two lines on the same points
    assert len({line.get_marker() for line in lines}) == 3
    assert all(abs(x - round(x)) <= 0.1 for line in lines for x in line.get_xdata())  # still at their iteration


def test_one_curve_is_drawn_at_its_own_iterations(monkeypatch, tmp_path):
    figures = _captured(monkeypatch)
    plots.plot_curves({"only": [(2, 0.5), (0, 0.1)]}, title="t", ylabel="y", path=tmp_path / "x.png")
    (line,) = figures[0].axes[0].get_lines()
    assert list(line.get_xdata()) == [0, 2] and list(line.get_ydata()) == [0.1, 0.5]


def test_files_are_written(tmp_path):
    curve = plots.plot_curves({"a": [(0, 0.1), (1, 0.2)]}, title="t", ylabel="y", path=tmp_path / "c.png")
    bars = plots.plot_bars({"a": (0.2, 0.01), "b": (0.3, 0.02)}, title="t", ylabel="y", path=tmp_path / "b.png")
    assert curve.stat().st_size > 0 and bars.stat().st_size > 0
