"""The iteration page's episode filter cannot read what the page does not show, nor run unbounded
(issue 55): the attacks of the issue, through the real viewer over real HTTP on 127.0.0.1.

A filter with a subquery into `prompts` printed the gold answer in the error page; here every form
that reaches another table (a subquery, a CTE, `read_parquet`, the catalog's own functions) is
refused, a message of a filter that failed while running quotes no data, and a filter that runs
past its time limit is stopped, its process gone."""

from __future__ import annotations

import html
import multiprocessing
import re
import urllib.parse
from pathlib import Path

import duckdb
import pytest

from tests.viewer_served import Served, train_view_run

pytestmark = pytest.mark.slow
PAGE = "/run/view-run/iteration/1"


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return train_view_run(tmp_path_factory.mktemp("attacks"))


@pytest.fixture(scope="module")
def gold(data_root) -> tuple[str, str]:
    """(prompt_id, its gold answer) of iteration 1, read straight from the Parquet file."""
    with duckdb.connect() as con:
        return con.execute("SELECT prompt_id, json_extract_string(ground_truth, '$.answers[0]') FROM read_parquet(?) "
                           "ORDER BY prompt_id LIMIT 1",
                           [str(data_root / "runs/view-run/iteration=1/prompts.parquet")]).fetchone()


def _filtered(served: Served, where: str) -> tuple[int, str]:
    return served.get(f"{PAGE}?where={urllib.parse.quote(where)}")


def _message(page: str) -> str:
    return html.unescape(re.search(r'id="error">([^<]*)<', page).group(1))


def _episodes_where(root: Path, condition: str) -> int:
    """Episodes of iteration 1 meeting `condition` over (reward, termination), from the files."""
    with duckdb.connect() as con:
        return con.execute(
            "SELECT count(*) FROM (SELECT s.episode_id, max(CASE WHEN s.done THEN s.termination END) AS termination "
            "FROM read_parquet(?) s GROUP BY 1) JOIN (SELECT episode_id, sum(reward) AS reward FROM read_parquet(?) "
            f"GROUP BY 1) USING (episode_id) WHERE {condition}",
            [str(root / "runs/view-run/iteration=1/steps.parquet"),
             str(root / "runs/view-run/iteration=1/rewards.parquet")]).fetchone()[0]


def test_the_gold_answer_filter_of_the_issue_shows_no_gold_answer(data_root, gold):
    prompt_id, answer = gold
    where = (f"(select error('GOLD:'||json_extract_string(ground_truth,'$.answers[0]')) from prompts "
             f"where prompt_id='{prompt_id}') is null")
    with Served(data_root) as served:
        status, page = _filtered(served, where)
    assert status == 400 and answer and f"GOLD:{answer}" not in html.unescape(page)
    assert "subquery" in _message(page)


@pytest.mark.parametrize("where", [
    "prompt_id in (select prompt_id from prompts where ground_truth like '%a%')",  # an oracle: rows or none
    "episode_id in (select episode_id from read_parquet('{root}/runs/view-run/iteration=1/prompts.parquet'))",
    "exists (select * from duckdb_tables())",
    "prompt_id in (with g as (select * from prompts) select prompt_id from g)",
    "(select count(*) from range(10000000000000)) > 0",
    "reward > 0) union select * from prompts --",
    "reward > 0\n) order by reward limit 1 --",
])
def test_a_filter_that_reaches_past_the_pages_rows_is_refused_unrun(data_root, where):
    with Served(data_root) as served:
        status, page = _filtered(served, where.format(root=data_root))
    assert status == 400 and _message(page).startswith("the filter")
    assert "episode_id=" not in page and "/episode/" not in page  # no row shown: no oracle


def test_the_filter_sees_only_the_iterations_episode_rows(data_root):
    """The second lock alone (no parse check): the child's catalog has no table but the page's rows."""
    import pyarrow as pa

    from agent_core.io.row_filter import FilterError, _in_child

    with pytest.raises(FilterError, match="prompts does not exist"):
        _in_child(pa.table({"episode_id": ["e"]}), "SELECT * FROM episodes WHERE prompt_id IN (FROM prompts)", 30)
    with pytest.raises(FilterError, match="(?i)permission|not allowed|disabled"):
        _in_child(pa.table({"episode_id": ["e"]}), f"FROM read_parquet('{data_root}/runs/view-run/iteration=1/"
                  "prompts.parquet')", 30)


def test_a_filter_that_fails_while_running_quotes_no_data(data_root):
    with Served(data_root) as served:
        status, page = _filtered(served, "error('Q' || upper(episode_id)) is null")
    message = _message(page)
    assert status == 400 and "InvalidInputException" in message
    assert not re.search(r"Q[A-Z0-9]", message)  # error()'s text, made from the data, is not shown


def test_a_filter_past_its_time_limit_is_stopped_and_its_process_ends(data_root):
    with Served(data_root, filter_timeout=2.0) as served:
        status, page = _filtered(served, "list_sum(range(100000000)) > 0")  # folded by DuckDB: deaf to interrupt
        assert status == 400 and "ran longer than 2 s and was stopped" in _message(page)
        assert [p for p in multiprocessing.active_children() if p.name == "agentr1-filter"] == []


def test_ordinary_filters_still_narrow_the_episodes(data_root):
    with Served(data_root) as served:
        _, everything = served.get(PAGE)
        _, rewarded = _filtered(served, "reward > 0")
        _, answered = _filtered(served, "termination = 'answered'")
    assert rewarded.count("/episode/") == _episodes_where(data_root, "reward > 0") <= everything.count("/episode/")
    assert answered.count("/episode/") == _episodes_where(data_root, "termination = 'answered'")
    assert everything.count("/episode/") > 0
