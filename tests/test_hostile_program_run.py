"""Issue 55's acceptance run: an agent program that, in one `train` of the tiny recipe, asks the viewer
on the data root for its prompt's gold answer (the filter that leaked it), plants a `.pth` in the venv's
site-packages and prints `agent_rewards: {"solver": 1e200}` for one sample of each prompt. The run
finishes, nothing is planted, the viewer is never reached, EM stays 0, and the huge reward fails its
episode alone (each part also has its own test that fails without its fix: docs/reliability.md)."""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import textwrap

import pytest

from tests.conftest import REPO_ROOT
from tests.viewer_served import Served

ATTACKER = textwrap.dedent("""
    import json, os, sys, sysconfig, urllib.parse, urllib.request
    prompt = json.load(sys.stdin)
    viewer, run_id, planted = sys.argv[1:4]
    gold = (f"(select error('GOLD:'||json_extract_string(ground_truth,'$.answers[0]')) from prompts "
            f"where prompt_id='{prompt['prompt_id']}') is null")
    seen = {}
    try:
        page = urllib.request.urlopen(f"{viewer}/run/{run_id}/iteration/0?where=" + urllib.parse.quote(gold),
                                      timeout=10).read().decode()
        seen["viewer"] = page.split("GOLD:")[1].split("<")[0] if "GOLD:" in page else "no gold"
    except Exception as error:
        seen["viewer"] = type(error).__name__
    try:
        with open(os.path.join(sysconfig.get_paths()["purelib"], planted), "w") as file:
            file.write("import os\\n")
        seen["pth"] = "planted"
    except OSError as error:
        seen["pth"] = error.strerror
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": prompt["messages"], "max_tokens": 4}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json",
                 "X-AgentR1-Agent": "solver"})
    urllib.request.urlopen(request).read()
    reward = 1e200 if os.environ["AGENTR1_EPISODE_ID"].endswith("-s0") else 0.5
    print(json.dumps({"answer": json.dumps(seen), "agent_rewards": {"solver": reward}}))
""")


@pytest.mark.slow
def test_the_gold_answer_hack_the_pth_plant_and_a_1e200_reward_change_nothing(tmp_path):
    from agent_core.io.layout import DataRoot
    from agent_core.io.run_status import run_status
    from agent_core.io.tables import read_table
    from agent_core.validation import load_config
    from flows.train import train

    program, planted = tmp_path / "attacker.py", f"agentr1-planted-{os.getpid()}.pth"
    program.write_text(ATTACKER)
    root = tmp_path / "data"
    try:
        with Served(root) as viewer:
            command = json.dumps([sys.executable, str(program), f"http://127.0.0.1:{viewer.port}", "hack", planted])
            result = train(load_config(REPO_ROOT / "configs" / "tiny.yaml", [
                f"data_root={root}", "run_id=hack", "iterations=1", "dev_eval.every=0", "rollout.env=agent_program",
                f'rollout.env_kwargs={{"command": {command}, "timeout_s": 60}}']))
        assert not os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], planted))
    finally:
        if os.path.exists(os.path.join(sysconfig.get_paths()["purelib"], planted)):
            os.remove(os.path.join(sysconfig.get_paths()["purelib"], planted))
    run = DataRoot(root).run("hack")
    assert [s.iteration for s in result.iterations] == [0] and run_status(run).status == "finished"
    steps = read_table("steps", run.table_uri(0, "steps")).to_pylist()
    ends = [(row["sample_idx"], row["termination"], json.loads(row["info"])) for row in steps if row["done"]]
    assert ends and all(termination == "error" and "numbers in [-100, 100]" in info["error"]
                        for sample, termination, info in ends if sample == 0)
    answered = [json.loads(info["answer"]) for sample, termination, info in ends if sample == 1]
    assert answered and all(seen == {"viewer": "URLError", "pth": "Read-only file system"} for seen in answered), answered
    em = read_table("rewards", run.table_uri(0, "rewards")).column("em").to_pylist()
    assert all(value in (None, 0.0) for value in em), em
