"""`agentr1 view` (agent_core/viewer, agent_core/io/trace_view.py) on a real tiny run, over real HTTP
(werkzeug's server on 127.0.0.1, `http.client`) and in a real headless browser (Chromium from the OS
packages, driven by Playwright: tests/test_viewer.py::test_in_a_browser...).

What is checked against the tables themselves, not against hard-coded values: the tokens the episode
page shows as trained are exactly the steps table's action tokens that have an advantages row, and
the advantages shown are the advantages table's."""

from __future__ import annotations

import html
import os
import http.client
import re
import shutil
import socket
import urllib.parse
from pathlib import Path

import duckdb
import pytest

from tests.conftest import REPO_ROOT
from tests.viewer_served import BOUND_S, TRACES, Served, train_view_run

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return train_view_run(tmp_path_factory.mktemp("view"))


@pytest.fixture(scope="module")
def masked_root(data_root, tmp_path_factory) -> Path:
    """A copy of the run whose first episode's step 1 has no advantages row (as a step left out of
    training has none): its tokens must show as not trained, the other steps' as trained."""
    root = tmp_path_factory.mktemp("masked") / "data"  # the default folder's name: the screenshots show it
    shutil.copytree(data_root, root, ignore=shutil.ignore_patterns(".query-*", "*.lock"))
    table = root / "runs/view-run/iteration=1/advantages.parquet"
    kept = table.with_name("kept.tmp")
    with duckdb.connect() as con:
        con.execute(f"COPY (SELECT * FROM read_parquet('{table}') WHERE NOT (episode_id = ? AND step_idx = 1)) "
                    f"TO '{kept}' (FORMAT parquet)", [_first_episode(data_root)])
    kept.replace(table)
    return root


def _steps(root: Path, episode_id: str) -> list[tuple]:
    """(response_ids, advantages or None) per step, straight from the Parquet files."""
    with duckdb.connect() as con:
        return con.execute(
            "SELECT s.response_ids, a.advantages FROM read_parquet(?) s LEFT JOIN read_parquet(?) a "
            "USING (episode_id, step_idx) WHERE s.episode_id = ? ORDER BY s.step_idx",
            [str(root / "runs/view-run/iteration=1/steps.parquet"),
             str(root / "runs/view-run/iteration=1/advantages.parquet"), episode_id]).fetchall()


def _first_episode(root: Path) -> str:
    with duckdb.connect() as con:
        return con.execute("SELECT min(episode_id) FROM read_parquet(?)",
                           [str(root / "runs/view-run/iteration=1/steps.parquet")]).fetchone()[0]


def test_pages_over_http_show_the_tables(masked_root):
    episode = _first_episode(masked_root)
    with Served(masked_root) as served:
        status, runs = served.get("/")
        assert status == 200 and 'href="/run/view-run"' in runs and "finished" in runs
        status, run = served.get("/run/view-run")
        assert status == 200 and 'href="/run/view-run/iteration/1"' in run and 'id="health"' in run
        status, episodes = served.get("/run/view-run/iteration/1")
        assert status == 200 and urllib.parse.quote(episode) in episodes
        status, page = served.get(f"/run/view-run/iteration/1/episode/{urllib.parse.quote(episode)}")
        assert status == 200
        shown = [(int(i), a) for i, a in re.findall(r'class="tok (?:un)?trained" data-id="(\d+)" data-logprob="[^"]*" '
                                                    r'data-advantage="([^"]*)"', page)]
        steps = _steps(masked_root, episode)
        assert [advs is None for _, advs in steps][:2] == [False, True]  # the fixture's mask: both kinds shown
        expected = [(i, "" if advs is None else repr(advs[k])) for ids, advs in steps for k, i in enumerate(ids)]
        assert [i for i, _ in shown] == [i for i, _ in expected]
        assert [float(a) if a else None for _, a in shown] == pytest.approx(
            [float(a) if a else None for _, a in expected])
        sql = html.unescape(re.search(r'<pre id="sql">(.*?)</pre>', page, re.DOTALL).group(1))
        assert f"s.episode_id = '{episode}'" in sql
    from agent_core.io.query import run_query  # "copy as SQL": `agentr1 query` gives the page's steps

    reproduced = run_query(masked_root, sql).to_pylist()
    assert [row["advantages"] is None for row in reproduced] == [advs is None for _, advs in steps]


@pytest.mark.parametrize("where", ["1=1; COPY steps TO 'stolen.csv'",
                                   "episode_id IN (SELECT content FROM read_text('/etc/passwd'))",
                                   "episode_id IN (SELECT * FROM read_csv('/etc/hostname'))"])
def test_a_hostile_filter_is_refused_with_a_message(data_root, where):
    with Served(data_root) as served:
        status, page = served.get(f"/run/view-run/iteration/1?where={urllib.parse.quote(where)}")
    assert status == 400
    message = html.unescape(re.search(r'id="error">([^<]*)<', page).group(1))
    assert message.strip() and "root:" not in message
    assert not (data_root / "stolen.csv").exists() and not Path("stolen.csv").exists()


def test_a_filter_narrows_and_sorts_the_episodes(data_root):
    with Served(data_root) as served:
        _, everything = served.get("/run/view-run/iteration/1")
        _, one_step = served.get("/run/view-run/iteration/1?where=" + urllib.parse.quote("steps = 1"))
    with duckdb.connect() as con:
        expected = con.execute("SELECT count(*) FROM (SELECT episode_id FROM read_parquet(?) GROUP BY 1 "
                               "HAVING count(*) = 1)", [str(data_root / "runs/view-run/iteration=1/steps.parquet")]
                               ).fetchone()[0]
    assert one_step.count("/episode/") == expected <= everything.count("/episode/")


def test_a_damaged_table_breaks_its_page_only(data_root, tmp_path):
    copy = tmp_path / "root"
    shutil.copytree(data_root, copy, ignore=shutil.ignore_patterns(".query-*", "*.lock"))
    (copy / "runs/view-run/iteration=1/steps.parquet").write_bytes(b"PAR1 not a table PAR1")
    with Served(copy) as served:
        status, page = served.get("/run/view-run/iteration/1")
        assert status == 400 and "steps" in html.unescape(re.search(r'id="error">([^<]*)<', page).group(1))
        assert served.get("/")[0] == 200
        assert served.get("/run/view-run/iteration/0")[0] == 200


def test_it_listens_on_127_0_0_1_only_by_default(data_root):
    from flows.cli import _parser

    args = _parser().parse_args(["view", "--data-root", str(data_root)])
    assert args.host == "127.0.0.1"
    with Served(data_root, args.host) as served:
        assert served.server.server_address[0] == "127.0.0.1"
        other = _an_address_not_loopback()
        if other is not None:  # the port is not open on the machine's other addresses
            with pytest.raises(OSError):
                socket.create_connection((other, served.port), timeout=5).close()


def _an_address_not_loopback() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_in_a_browser_the_trained_tokens_are_the_loss_mask_and_the_advantages_the_tables(masked_root, tmp_path,
                                                                                          monkeypatch):
    from playwright.sync_api import sync_playwright

    monkeypatch.chdir(masked_root.parent)  # served as `data`, as `agentr1 view` does by default: no temp path shown

    assert CHROMIUM, "no chromium: `make test-slow` installs it (apt-get install chromium)"
    episode = _first_episode(masked_root)
    shots = Path(os.environ.get("AGENTR1_SCREENSHOTS", tmp_path / "shots"))  # the README's: docs/images/viewer
    with Served(Path(masked_root.name)) as served, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.set_default_timeout(BOUND_S * 1000)
            page.goto(f"http://127.0.0.1:{served.port}/")
            assert page.inner_text("h1") == "Runs under data"
            page.screenshot(path=str(shots / "runs.png"), full_page=True)
            page.click("text=view-run")
            page.wait_for_selector("#iterations")
            page.screenshot(path=str(shots / "run.png"), full_page=True)
            page.click('#iterations a[href$="/iteration/1"]')
            page.wait_for_selector("#episodes")
            page.screenshot(path=str(shots / "iteration.png"), full_page=True)
            page.click(f'a[href$="/episode/{urllib.parse.quote(episode)}"]')
            page.wait_for_selector(".step")
            page.screenshot(path=str(shots / "episode.png"), full_page=True)
            steps = page.eval_on_selector_all(".step", """sections => sections.map(s => Array.from(
                s.querySelectorAll('.tok')).map(t => [Number(t.dataset.id), t.classList.contains('trained'),
                t.dataset.advantage === '' ? null : Number(t.dataset.advantage),
                getComputedStyle(t).textDecorationLine]))""")
            page.goto(f"http://127.0.0.1:{served.port}/run/view-run/iteration/1")
            page.click('#episodes a[href^="/compare"]')
            page.wait_for_selector(".side")
            page.screenshot(path=str(shots / "compare.png"), full_page=True)
            page.goto(f"http://127.0.0.1:{served.port}/run/view-run/iteration/1?where="
                      + urllib.parse.quote("1=1; COPY steps TO 'x.csv'"))
            refused = page.inner_text("#error")
        finally:
            browser.close()
    expected = _steps(masked_root, episode)
    assert [[t[0] for t in step] for step in steps] == [list(ids) for ids, _ in expected]
    for step, (ids, advantages) in zip(steps, expected):
        assert [t[1] for t in step] == [advantages is not None] * len(ids)  # trained = in the loss mask
        assert all(("line-through" in t[3]) != t[1] for t in step)  # what is not trained is shown struck
        if advantages is not None:
            assert [t[2] for t in step] == pytest.approx(list(advantages), abs=1e-6)
    assert any(t[1] for step in steps for t in step) and not all(t[1] for step in steps for t in step)
    assert "syntax" in refused
    assert sorted(p.name for p in shots.iterdir()) == ["compare.png", "episode.png", "iteration.png", "run.png",
                                                       "runs.png"]


def test_agentr1_view_serves_until_interrupted_and_refuses_a_root_without_runs(data_root, tmp_path):
    import signal
    import subprocess
    import sys

    empty = subprocess.run([sys.executable, "-m", "flows.cli", "view", "--data-root", str(tmp_path)],
                           capture_output=True, text=True, timeout=BOUND_S, cwd=REPO_ROOT)
    assert empty.returncode == 2 and "no runs under" in empty.stderr
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "view", "--data-root", str(data_root), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        line = process.stdout.readline()  # the URL line; the command prints it before serving
        url = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert url, line + process.stderr.read() if process.poll() is not None else line
        connection = http.client.HTTPConnection("127.0.0.1", int(url.group(1)), timeout=BOUND_S)
        connection.request("GET", "/")
        response = connection.getresponse()
        assert response.status == 200 and b"view-run" in response.read()
        connection.close()
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(BOUND_S)


def test_compare_shows_one_prompts_episodes_of_two_runs_side_by_side(data_root, tmp_path):
    copy = tmp_path / "root"
    shutil.copytree(data_root, copy, ignore=shutil.ignore_patterns(".query-*", "*.lock"))
    shutil.copytree(copy / "runs/view-run", copy / "runs/view-run-b")  # a second run: the same episodes
    with duckdb.connect() as con:
        prompt, episodes = con.execute(
            "SELECT prompt_id, list(DISTINCT episode_id ORDER BY episode_id) FROM read_parquet(?) GROUP BY 1 "
            "ORDER BY 1 LIMIT 1", [str(data_root / "runs/view-run/iteration=1/steps.parquet")]).fetchone()
    with Served(copy) as served:
        status, page = served.get(f"/compare?prompt_id={urllib.parse.quote(prompt)}&a=view-run/1&b=view-run-b/1")
        assert status == 200
        sides = page.split('class="side"')[1:]
        assert len(sides) == 2
        for side in sides:
            assert sorted(re.findall(r'/episode/([^"]+)"', side)) == [urllib.parse.quote(e) for e in episodes]
        _, iteration_page = served.get("/run/view-run/iteration/1")
        assert f"/compare?prompt_id={urllib.parse.quote(prompt)}&a=view-run/0&b=view-run/1" in iteration_page
        assert served.get("/compare?prompt_id=x&a=view-run")[0] == 400


def test_the_runs_page_totals_each_runs_alerts_and_cost(data_root, tmp_path):
    from agent_core.io.layout import DataRoot
    from agent_core.io.trace_view import runs_overview

    root = tmp_path / "root"
    shutil.copytree(data_root, root, ignore=shutil.ignore_patterns(".query-*", "*.lock"))
    shutil.copytree(root / "runs/view-run", root / "runs/priced-run")
    iteration = root / "runs/priced-run/iteration=1"
    with duckdb.connect() as con:  # a price on one iteration's stages, and two of its checks in alert
        for table, change in (("ledger", "* REPLACE (2.0 AS price_per_hour, 'USD' AS currency)"),
                              ("health", "* REPLACE (CASE WHEN check_name IN (SELECT check_name FROM t ORDER BY "
                                         "check_name LIMIT 2) THEN 'alert' ELSE status END AS status)")):
            path = iteration / f"{table}.parquet"
            con.execute(f"CREATE OR REPLACE TABLE t AS SELECT * FROM read_parquet('{path}')")
            con.execute(f"COPY (SELECT {change} FROM t) TO '{path}' (FORMAT parquet)")
        runs = f"{root}/runs/*/iteration=*/"
        expected = dict(con.execute(
            f"SELECT split_part(filename, '/runs/', 2)[:position('/' IN split_part(filename, '/runs/', 2)) - 1], "
            f"count(*) FILTER (WHERE status = 'alert') FROM read_parquet('{runs}health.parquet', filename = true) "
            "GROUP BY 1").fetchall())
        wall, cost = con.execute(f"SELECT sum(wall_seconds), sum(device_seconds / 3600 * price_per_hour) FROM "
                                 f"read_parquet('{root}/runs/priced-run/iteration=*/ledger.parquet')").fetchone()
    overview = {r.status.run_id: r for r in runs_overview(DataRoot(root))[0]}
    assert overview["priced-run"].alerts == expected["priced-run"] >= 2
    assert overview["view-run"].alerts == expected["view-run"]
    assert overview["priced-run"].cost == pytest.approx(cost) and overview["priced-run"].currency == "USD"
    assert wall > 0 and overview["priced-run"].wall_seconds == pytest.approx(wall)
    assert overview["view-run"].cost is None  # no price: the page shows its minutes
    with Served(root) as served:
        status, page = served.get("/")
    assert status == 200 and f"{cost:.2f} USD" in page
    assert f"{overview['view-run'].wall_seconds / 60:.1f} min" in page


def test_sampled_episodes_are_mlflow_traces_carrying_the_tables_rewards_and_advantages(data_root):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{data_root}/mlflow.db")
    experiment = client.get_experiment_by_name("agentr1").experiment_id
    (run,) = client.search_runs([experiment], "tags.`agentr1.run_id` = 'view-run'")
    traces = client.search_traces(locations=[experiment], run_id=run.info.run_id, max_results=100)
    by_iteration: dict[int, list] = {}
    for trace in traces:
        root = next(span for span in trace.data.spans if span.parent_id is None)
        by_iteration.setdefault(root.attributes["iteration"], []).append((root, trace.data.spans))
    assert sorted(by_iteration) == [0, 1] and all(len(v) == TRACES for v in by_iteration.values())
    with duckdb.connect() as con:
        for k, logged in by_iteration.items():
            tables = {t: str(data_root / f"runs/view-run/iteration={k}/{t}.parquet") for t in ("rewards", "advantages")}
            rewards = dict(con.execute("SELECT episode_id, sum(reward) FROM read_parquet(?) GROUP BY 1",
                                       [tables["rewards"]]).fetchall())
            shown = {root.attributes["episode_id"]: root.attributes["reward"] for root, _ in logged}
            assert shown == pytest.approx({e: rewards[e] for e in shown})
            assert min(rewards.values()) in shown.values() and max(rewards.values()) in shown.values()  # the spread
            for root, spans in logged:
                steps = sorted((s for s in spans if s.parent_id == root.span_id), key=lambda s: s.name)
                expected = con.execute(
                    "SELECT r.step_idx, r.reward, list_avg(a.advantages) FROM read_parquet(?) r LEFT JOIN "
                    "read_parquet(?) a USING (episode_id, step_idx) WHERE r.episode_id = ? ORDER BY r.step_idx",
                    [tables["rewards"], tables["advantages"], root.attributes["episode_id"]]).fetchall()
                assert [s.name for s in steps] == [f"step {i}" for i, _, _ in expected]
                assert [s.attributes["reward"] for s in steps] == pytest.approx([r for _, r, _ in expected])
                assert [s.attributes.get("advantage") for s in steps] == pytest.approx([a for _, _, a in expected])
