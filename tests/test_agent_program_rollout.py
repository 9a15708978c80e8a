"""Env `agent_program` through its rollout driver (agent_core/drivers roll_out): programs run against
the gateway over the tiny policy's hf engine, their calls become a valid steps table holding exactly
what the engine produced, the program's answer reaches the scorer, and a program that crashes,
hangs or prints no answer is a failed episode with its reason, never a failed rollout."""

from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from agent_core.config import RolloutConfig
from agent_core.data.rows import document_to_row
from agent_core.io.tables import read_table, rows_of, write_table
from agent_core.rewards.labelling import StepOutcome, label_steps
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.hf_engine import HFEngine
from agent_core.gateway.program_rollout import PreflightError
from agent_core.rollout.records import episode_failures
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import ChatMessage, Document, Prompt
from agent_core.validation import load_config
from agent_core.drivers import DataAccess, roll_out

REPO_ROOT = Path(__file__).resolve().parent.parent
AGENT = REPO_ROOT / "examples" / "openai_agent" / "agent.py"
DOCUMENTS = [Document("d0", "Harbor", "The Silent Harbor was directed by Ana Kowalski."),
             Document("d1", "Ana", "Ana Kowalski was born in Gdansk.")]
TEXTS = ["Who directed The Silent Harbor? Ana Kowalski was born in Gdansk.",
         '<tool_call>\n{"name": "search", "arguments": {"query": "Harbor"}}\n</tool_call>'] * 20

# A program that asks once through plain HTTP (no client library: it starts fast) and answers;
# its behaviour after the call is chosen by argv[1].
ONE_CALL = textwrap.dedent("""
    import json, os, sys, time, urllib.request
    prompt = json.load(sys.stdin)
    request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "policy", "messages": prompt["messages"]}).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
    reply = json.load(urllib.request.urlopen(request))
    mode = sys.argv[1]
    if mode == "answer":
        print(json.dumps({"answer": "Ana Kowalski"}))
    elif mode == "blank":  # out of turns with no answer, as the example agent prints then
        print(json.dumps({"answer": " "}))
    elif mode == "garbage":
        print("I think it is Ana")
    elif mode == "crash":
        sys.exit("the agent fell over")
    elif mode == "hang":
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TEXTS, vocab_size=320)


@pytest.fixture(scope="module")
def engine(tokenizer):
    policy = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    return HFEngine(policy, tokenizer)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_table("corpus", [document_to_row(d) for d in DOCUMENTS],
                       tmp_path_factory.mktemp("corpus") / "corpus.parquet")


def _prompts(count: int = 2) -> list[Prompt]:
    return [Prompt(f"q{k}", "test", "train", (ChatMessage("user", "Who directed The Silent Harbor?"),),
                   ("Ana Kowalski",), "search_qa") for k in range(count)]


def _cfg(command: list[str], max_context_tokens: int = 512, max_steps: int = 3, **kwargs) -> RolloutConfig:
    return RolloutConfig(env="agent_program", env_kwargs={"command": command, **kwargs}, group_size=2,
                         max_steps=max_steps, max_new_tokens=8, max_context_tokens=max_context_tokens)


def _roll(engine, tokenizer, cfg, corpus=None, prompts=None):
    return roll_out(engine, tokenizer, prompts or _prompts(), DOCUMENTS, cfg, seed=5, policy_version=0,
                    episode_prefix="r-i0-", access=DataAccess(corpus))


def _table(records, tmp_path):
    return read_table("steps", write_table("steps", rows_of(records, run_id="r", iteration=0), tmp_path / "steps.parquet"))


def test_the_example_agent_through_the_real_client_records_what_the_engine_produced(engine, tokenizer, corpus, tmp_path):
    pytest.importorskip("openai")
    # the tool list in the system message is ~1,000 tokens with the tiny policy's 320-token vocabulary
    cfg = _cfg([sys.executable, str(AGENT), "--max-tokens", "8"], max_context_tokens=2048, timeout_s=60.0)
    records = _roll(engine, tokenizer, cfg, corpus)
    steps = _table(records, tmp_path)  # validated by the steps schema
    assert sorted(set(steps.column("episode_id").to_pylist())) == [f"r-i0-q{p}-s{s}" for p in range(2) for s in range(2)]
    sampling = SamplingParams(max_new_tokens=8, seed=0, stop_token_ids=eos_token_ids(tokenizer))
    for record in records:
        info = json.loads(record.info)
        assert info.get("gateway_calls") != 0, info  # every program made its calls (none failed)
        (own,) = engine.generate([record.prompt_ids], replace(sampling, seed=info["seed"]))
        assert record.response_ids == own.token_ids
        assert record.response_logprobs == pytest.approx(own.logprobs, abs=1e-5)
    ends = [r for r in records if r.done]
    assert len(ends) == 4 and all(r.termination in ("answered", "max_steps") for r in ends)
    assert all(r.history == ("start" if r.step_idx == 0 else "appended") for r in records)


def test_the_programs_answer_reaches_the_scorer(engine, tokenizer):
    records = _roll(engine, tokenizer, _cfg([sys.executable, "-c", ONE_CALL, "answer"]))
    outcomes = [StepOutcome(r.episode_id, r.group_id, r.prompt_id, r.sample_idx, r.step_idx, r.env_reward, r.done,
                            r.termination, r.info) for r in records]
    rewards = label_steps(outcomes, {"q0": ["Ana Kowalski"], "q1": ["Ana Kowalski"]}, scorer="qa_em", format_weight=0.0)
    assert [r.em for r in rewards] == [1.0] * 4
    assert all(r.history == "start" and r.termination == "answered" for r in records)


def test_a_blank_answer_is_no_answer_and_earns_no_format_reward(engine, tokenizer, tmp_path):
    # The example agent prints {"answer": ""} when its --max-turns ran out on a tool call. Scored as
    # an answer, that earned the format reward of a wrong answer for searching on without answering.
    scored = {}
    for mode in ("blank", "answer"):
        records = _roll(engine, tokenizer, _cfg([sys.executable, "-c", ONE_CALL, mode]), prompts=_prompts(1))
        outcomes = [StepOutcome(r.episode_id, r.group_id, r.prompt_id, r.sample_idx, r.step_idx, r.env_reward, r.done,
                                r.termination, r.info) for r in records]
        scored[mode] = label_steps(outcomes, {"q0": ["Ana Kowalski"]}, scorer="qa_em", format_weight=0.1)
        if mode == "blank":
            assert [(r.termination, r.truncated) for r in records] == [("max_steps", True)] * 2
            assert all(json.loads(r.info)["unanswered"] == "the program printed a blank answer" for r in records)
            _table(records, tmp_path)  # a valid steps table: truncated iff a budget's termination
    assert [r.format_score for r in scored["blank"]] == [0.0, 0.0] and [r.reward for r in scored["blank"]] == [0.0, 0.0]
    assert [r.format_score for r in scored["answer"]] == [1.0, 1.0]


# Only the hang waits for its timeout; the others get room to start and call on a loaded machine
# (a 2 s limit once timed out a crash before it crashed, under a parallel job on 2 cores).
@pytest.mark.parametrize("mode, reason, timeout_s", [("crash", "exit code 1: the agent fell over", 60.0),
                                                     ("garbage", "no JSON answer on the last stdout line", 60.0),
                                                     ("hang", "timed out after 6 s", 6.0)])
def test_a_failing_program_is_a_failed_episode_with_its_reason(engine, tokenizer, tmp_path, mode, reason, timeout_s):
    cfg = _cfg([sys.executable, "-c", ONE_CALL, mode], timeout_s=timeout_s)
    records = _roll(engine, tokenizer, cfg, prompts=_prompts(1))
    steps = _table(records, tmp_path)
    assert steps.column("termination").to_pylist() == ["error", "error"]
    for info in map(json.loads, steps.column("info").to_pylist()):
        assert reason in info["error"], info
        assert info["seed"] is not None  # the step is the call the program made before it failed


def test_a_program_that_fails_before_any_call_leaves_one_step_with_no_action(engine, tokenizer, tmp_path):
    cfg = _cfg([sys.executable, "-c", "import sys; sys.exit(3)"])
    records = _roll(engine, tokenizer, cfg, prompts=_prompts(1))
    steps = _table(records, tmp_path)  # valid: a step with no action is allowed on a failed episode
    assert steps.num_rows == 2 and steps.column("termination").to_pylist() == ["error", "error"]
    # nothing the program did not send: no sampled action on the dataset's prompt
    assert steps.column("response_ids").to_pylist() == [[], []]
    assert steps.column("finish_reason").to_pylist() == ["none", "none"]
    info = json.loads(steps.column("info")[0].as_py())
    assert info["gateway_calls"] == 0 and info["error"].startswith("exit code 3")
    failures = episode_failures(records)
    assert failures.all_failed and failures.commonest_count == 2 and failures.commonest.startswith("exit code 3")


def test_a_first_request_over_the_context_fails_naming_the_numbers(engine, tokenizer):
    cfg = _cfg([sys.executable, "-c", ONE_CALL, "answer"], max_context_tokens=16)
    failures = episode_failures(_roll(engine, tokenizer, cfg, prompts=_prompts(1)))
    assert failures.all_failed, failures
    assert "refused the first request: the prompt is" in failures.commonest
    assert "exceeds the context of 16 tokens (rollout.max_context_tokens)" in failures.commonest
    # a run's first rollout runs one episode alone first, and stops there (no other program starts)
    with pytest.raises(PreflightError, match=r"preflight: the first episode \(r-i0-q0-s0\) failed before any call: "
                                             r".*the prompt is \d+ tokens.*context of 16 tokens"):
        roll_out(engine, tokenizer, _prompts(), DOCUMENTS, cfg, seed=5, episode_prefix="r-i0-", preflight=True,
                 access=DataAccess())


def test_the_preflight_episode_is_one_of_the_rollouts_episodes_when_it_works(engine, tokenizer):
    cfg = _cfg([sys.executable, "-c", ONE_CALL, "answer"])
    records = roll_out(engine, tokenizer, _prompts(), DOCUMENTS, cfg, seed=5, episode_prefix="r-i0-", preflight=True,
                       access=DataAccess())
    assert [r.episode_id for r in records] == [f"r-i0-q{p}-s{k}" for p in range(2) for k in range(2)]
    assert all(r.termination == "answered" for r in records)


def test_a_rollout_without_saying_what_its_programs_may_read_does_not_start(engine, tokenizer):
    # The warm start once ran its programs with no corpus by leaving `access` out; now leaving it out
    # is an error, and a rollout without the corpus says so (`DataAccess()`).
    cfg = _cfg([sys.executable, "-c", ONE_CALL, "answer"])
    with pytest.raises(TypeError, match="access"):
        roll_out(engine, tokenizer, _prompts(1), DOCUMENTS, cfg, seed=5)


def test_an_answer_printed_after_a_budget_refusal_is_scored(engine, tokenizer):
    # max_steps=1: the second call is refused; the program answers with what it has
    refused_then_answer = ONE_CALL.replace('mode = sys.argv[1]', textwrap.dedent("""
        try:
            urllib.request.urlopen(request)
        except urllib.error.HTTPError as refusal:
            assert refusal.code == 400, refusal.code
        mode = sys.argv[1]"""))
    cfg = _cfg([sys.executable, "-c", "import urllib.error\n" + refused_then_answer, "answer"], max_steps=1)
    records = _roll(engine, tokenizer, cfg, prompts=_prompts(1))
    assert [r.termination for r in records] == ["answered", "answered"]
    assert all(json.loads(r.info)["refused"] == "max_steps" for r in records)
    outcomes = [StepOutcome(r.episode_id, r.group_id, r.prompt_id, r.sample_idx, r.step_idx, r.env_reward, r.done,
                            r.termination, r.info) for r in records]
    rewards = label_steps(outcomes, {"q0": ["Ana Kowalski"]}, scorer="qa_em", format_weight=0.0)
    assert [r.em for r in rewards] == [1.0, 1.0]


def test_a_command_that_cannot_start_here_fails_before_the_run_naming_where_it_was_looked_for(
        tmp_path, monkeypatch, capsys):
    from flows.cli import main as cli_main

    monkeypatch.chdir(tmp_path)  # outside the checkout: the guide's relative command is not here
    args = ["train", "--config", str(REPO_ROOT / "configs" / "tiny.yaml"), "--data-root", str(tmp_path / "data"),
            "--set", "rollout.env=agent_program"]
    relative = 'rollout.env_kwargs={"command": ["python", "examples/openai_agent/agent.py"]}'
    assert cli_main([*args, "--set", relative]) == 2
    err = capsys.readouterr().err
    assert "rollout.env_kwargs.command" in err and "examples/openai_agent/agent.py, which is not a file" in err
    assert f"resolved against {tmp_path}" in err and not (tmp_path / "data").exists()  # nothing started
    assert cli_main([*args, "--set", 'rollout.env_kwargs={"command": ["no-such-interpreter-here"]}']) == 2
    assert "'no-such-interpreter-here' is not on PATH" in capsys.readouterr().err


# Two agents in one program: a planner asks, a solver asks, the planner goes on with its own conversation.
TWO_AGENTS = textwrap.dedent("""
    import json, os, sys, urllib.request
    prompt = json.load(sys.stdin)
    def ask(agent, messages):
        request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            data=json.dumps({"model": "policy", "messages": messages}).encode(),
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json",
                     "X-AgentR1-Agent": agent})
        return json.load(urllib.request.urlopen(request))["choices"][0]["message"]
    plan = [{"role": "system", "content": "You plan."}, *prompt["messages"]]
    plan.append(ask("planner", plan))
    ask("solver", [{"role": "user", "content": "Solve: " + plan[-1]["content"]}])
    plan.append({"role": "user", "content": "The solver answered. Go on."})
    ask("planner", plan)
    print(json.dumps({"answer": "Ana Kowalski", "agent_rewards": {"solver": 0.5}}))
""")


def test_each_named_agent_of_a_program_is_its_own_episode_whose_conversation_packs(engine, tokenizer, tmp_path):
    records = _roll(engine, tokenizer, _cfg([sys.executable, "-c", TWO_AGENTS], max_context_tokens=2048),
                    prompts=_prompts(1))
    steps = _table(records, tmp_path)  # valid: each agent's episode is whole
    rows = [r for r in steps.to_pylist() if r["sample_idx"] == 0]
    assert [(r["episode_id"], r["agent"], r["step_idx"], r["history"]) for r in rows] == [
        ("r-i0-q0-s0@planner", "planner", 0, "start"), ("r-i0-q0-s0@planner", "planner", 1, "appended"),
        ("r-i0-q0-s0@solver", "solver", 0, "start")]
    assert {r["group_id"] for r in rows} == {"r-i0-q0@planner", "r-i0-q0@solver"}
    ends = [r for r in rows if r["done"]]
    assert [(r["agent"], r["termination"]) for r in ends] == [("planner", "answered"), ("solver", "answered")]
    # the solver's own reward (agent_rewards) on its last step, on top of the answer's score both share
    assert [r["env_reward"] for r in rows] == [0.0, 0.0, 0.5]
    assert rows[0]["prefix_shared"] and "The solver answered" in rows[0]["observation_text"]


def test_a_reward_past_the_bound_fails_its_episode_not_the_run(engine, tokenizer, tmp_path):
    """The attack's answer line, `agent_rewards: {"solver": 1e200}` (finite, so once accepted): its episode
    fails with the reason; the other sample's bounded reward is kept; the steps table is valid."""
    huge = TWO_AGENTS.replace('{"solver": 0.5}', '{"solver": 1e200 if os.environ["AGENTR1_EPISODE_ID"].endswith("-s0") '
                                                 'else 0.5}')
    records = _roll(engine, tokenizer, _cfg([sys.executable, "-c", huge], max_context_tokens=2048), prompts=_prompts(1))
    rows = _table(records, tmp_path).to_pylist()
    ends = {(r["sample_idx"], r["agent"]): r for r in rows if r["done"]}
    for agent in ("planner", "solver"):
        assert ends[0, agent]["termination"] == "error"
        assert "agent_rewards must map agent names to numbers in [-100, 100]" in json.loads(ends[0, agent]["info"])["error"]
    assert ends[1, "solver"]["termination"] == "answered" and ends[1, "solver"]["env_reward"] == 0.5
    assert max(abs(r["env_reward"]) for r in rows) <= 100


def test_the_config_accepts_agent_program_and_checks_its_kwargs():
    base = REPO_ROOT / "configs" / "tiny.yaml"
    ok = load_config(base, ["rollout.env=agent_program", 'rollout.env_kwargs={"command": ["python", "agent.py"]}'])
    assert ok.rollout.env == "agent_program"
    with pytest.raises(Exception, match="command"):
        load_config(base, ["rollout.env=agent_program", 'rollout.env_kwargs={"command": "python agent.py"}'])


@pytest.mark.slow
def test_one_rl_iteration_of_the_pipeline_trains_on_the_example_agents_episodes(tmp_path):
    """`agentr1 train --config tiny --set rollout.env=agent_program ...` in one iteration: rollout
    through the gateway, labelling, advantages and an update, every table written and valid."""
    from agent_core.io.layout import DataRoot
    from agent_core.io.run_status import run_status
    from flows.train import train
    from tasks.rollout import RolloutFailedError

    command = json.dumps(["python", str(AGENT), "--max-tokens", "12"])
    settings = [f"data_root={tmp_path}", "iterations=1", "dev_eval.every=0", "rollout.env=agent_program",
                f'rollout.env_kwargs={{"command": {command}, "timeout_s": 120}}']
    # first an agent that crashes after its call: past the preflight, every episode fails, and the run says so
    crash = json.dumps([sys.executable, "-c", ONE_CALL, "crash"])
    failing = load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        *settings[:-1], f'rollout.env_kwargs={{"command": {crash}, "timeout_s": 60}}', "run_id=crash"])
    with pytest.raises(RolloutFailedError, match=r"6 of 6 episodes failed; 6 of them like: exit code 1: the agent "
                                                 r"fell over; every episode is in .*steps.parquet"):
        train(failing)
    failed = run_status(DataRoot(tmp_path).run("crash"))
    assert failed.status == "failed" and "6 of 6 episodes failed" in failed.detail
    assert MlflowClient(DataRoot(tmp_path).mlflow_tracking_uri).search_model_versions("name='agentr1-policy'") == []

    # the oracle's warm start through a program that offers no search tool: it solves nothing, and says so
    answers = json.dumps([sys.executable, "-c", ONE_CALL, "answer"])
    warm = ["warm_start.enabled=true", "warm_start.prompts=8", "warm_start.lazy_fraction=0.5"]
    toolless = load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        *settings[:-1], f'rollout.env_kwargs={{"command": {answers}}}', *warm, "run_id=toolless"])
    for attempt in ("first", "resumed"):  # a resume checks again: the failed stage was never committed
        with pytest.raises(ValueError, match="solved none of its 4 ideal episodes in env 'agent_program'"):
            train(toolless)

    # the example agent, with room for the oracle's calls (12 tokens cut them, and the warm start says so)
    roomy = json.dumps(["python", str(AGENT), "--max-tokens", "96"])
    config = load_config(REPO_ROOT / "configs" / "tiny.yaml", [
        *settings[:-1], f'rollout.env_kwargs={{"command": {roomy}, "timeout_s": 120}}', "run_id=gw",
        "rollout.max_context_tokens=2048", "rollout.max_new_tokens=96", *warm])
    result = train(config)
    run = DataRoot(tmp_path).run("gw")
    # the oracle played the example agent through the gateway: hermes calls it ran, the ideal half solved
    oracle = read_table("steps", str(run.warm_start_dir / "steps.parquet"))
    assert all(json.loads(info)["gateway"] for info in oracle.column("info").to_pylist())
    assert any(text.startswith("<tool_call>") for text in oracle.column("response_text").to_pylist())
    solved = read_table("rewards", str(run.warm_start_dir / "rewards.parquet")).column("em").to_pylist()
    assert sum(em for em in solved if em is not None) == 4
    steps = read_table("steps", run.table_uri(0, "steps"))
    infos = [json.loads(text) for text in steps.column("info").to_pylist()]
    assert all(info["gateway"] for info in infos)
    assert steps.num_rows >= config.data.prompts_per_iteration * config.rollout.group_size
    assert not any("error" in info for info in infos), [i.get("error") for i in infos]
    metrics = read_table("train_metrics", run.table_uri(0, "train_metrics"))
    assert metrics.num_rows >= 1 and (run.checkpoint_dir(0) / "model.safetensors").is_file()
    assert [s.iteration for s in result.iterations] == [0]
