"""Evaluation runs the run's env, scorer and loop settings (issue 32, item 5).

A run trained with `rollout.context_mode: last_k` (or an observation cut) is evaluated under it:
checked on the token ids the engine actually received, through training's rollout driver, in the
dev eval and in `agentr1 eval --run-id`'s flow. A custom env and scorer registered here evaluate
with no eval code of their own. The policy is a scripted engine registered in ENGINES (so the
stages load it by name, as they load hf) over the tiny run's real tokenizer; nothing is trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_core.envs.base import EnvStep
from agent_core.envs.registry import ENVS
from agent_core.eval.methods import EvalSettings, tool_agent_episodes
from agent_core.io.config_files import save_config
from agent_core.io.layout import DataRoot
from agent_core.io.tables import read_table
from agent_core.rewards.scorers import SCORERS, Score
from agent_core.rollout.engine import Generation
from agent_core.rollout.engines import ENGINES
from agent_core.rollout.spec import RolloutSpec
from agent_core.validation import load_config
from agent_core.drivers import roll_out

REPO_ROOT = Path(__file__).resolve().parent.parent
TINY = REPO_ROOT / "configs" / "tiny.yaml"
ASSISTANT = "<|im_start|>assistant"

ENGINE_NAME = "eval_test_scripted"
ENV_NAME = "eval_test_countdown"
SCORER_NAME = "eval_test_yes"


class ScriptedEngine:
    """Searches on every call, or says "yes" to the countdown env; records what each call received."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.contexts: list[list[int]] = []
        self.temperatures: list[float] = []

    def generate(self, prompts, params):
        out = []
        for ids in prompts:
            self.contexts.append(list(ids))
            self.temperatures.append(params.temperature)
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            action = "yes" if "countdown" in text else "<search>film director</search>"
            tokens = self.tokenizer.encode(action, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Generation(tokens, [-1.0] * len(tokens), "stop"))
        return out

    def texts(self) -> list[str]:
        return [self.tokenizer.decode(ids, skip_special_tokens=False) for ids in self.contexts]

    def turns_seen(self) -> list[int]:
        """Earlier assistant turns in each context received (the last marker is the generation prompt)."""
        return [text.count(ASSISTANT) - 1 for text in self.texts()]


ENGINES_BUILT: list[ScriptedEngine] = []


def _scripted_engine(policy_dir: Path, options) -> ScriptedEngine:
    from agent_core.io.checkpoints import load_tokenizer

    ENGINES_BUILT.append(ScriptedEngine(load_tokenizer(Path(policy_dir))))
    return ENGINES_BUILT[-1]


class CountdownEnv:
    """Says "countdown" twice, then takes the third action as the answer: three steps per episode."""

    observation_role = "user"

    def __init__(self):
        self.steps = 0

    def reset(self, prompt):
        return prompt.messages

    def step(self, action_text: str) -> EnvStep:
        self.steps += 1
        if self.steps < 3:
            return EnvStep(observation=f"countdown {3 - self.steps}", reward=0.0, done=False)
        return EnvStep(observation="", reward=0.0, done=True, termination="answered",
                       info={"answer": action_text.strip()})


def _yes_scorer(final_answer, answers, *, format_weight: float) -> Score:
    """em 1 for the answer "yes" (whatever the gold answers), f1 a constant quarter: only this scorer gives these."""
    em = 1.0 if final_answer == "yes" else 0.0
    return Score(outcome=em, em=em, f1=0.25, format_score=1.0, components={"em": em})


if ENGINE_NAME not in ENGINES:
    ENGINES.register(ENGINE_NAME)(_scripted_engine)
if ENV_NAME not in ENVS:
    ENVS.register(ENV_NAME)(lambda resources: CountdownEnv())
if SCORER_NAME not in SCORERS:
    SCORERS.register(SCORER_NAME)(_yes_scorer)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny run's dataset and initial policy (untrained; its tokenizer is what matters)."""
    from tasks.init_policy import init_policy
    from tasks.prepare_data import prepare_dataset

    data_root = tmp_path_factory.mktemp("eval-any-env")
    config = load_config(TINY, [f"data_root={data_root}", "run_id=any-env"])
    run = DataRoot(data_root).run("any-env")
    dataset = prepare_dataset.fn(str(data_root), config.data)
    policy_dir = init_policy.fn(run, dataset, config.policy)
    return data_root, dataset, policy_dir


def _config(data_root: Path, *overrides: str):
    return load_config(TINY, [f"data_root={data_root}", "run_id=any-env", *overrides])


def _agent_run(tiny_run, *overrides: str, limit: int = 2) -> ScriptedEngine:
    """The `agent` method (through the rollout drivers) with the run's eval settings."""
    from agent_core.io.checkpoints import load_tokenizer
    from tasks._common import read_corpus, split_prompts
    from tasks.evaluate import run_eval_settings

    data_root, dataset, policy_dir = tiny_run
    settings = run_eval_settings(_config(data_root, *overrides), greedy=True)
    engine = ScriptedEngine(load_tokenizer(Path(policy_dir)))
    episodes = tool_agent_episodes(engine, engine.tokenizer, split_prompts(dataset, "dev", limit),
                                   read_corpus(dataset.corpus_uri), settings)
    assert [e.termination for e in episodes] == ["max_steps"] * limit  # tiny: 3 searches, cut off
    return engine


def test_a_last_k_run_is_evaluated_under_last_k(tiny_run):
    append = _agent_run(tiny_run)
    last_k = _agent_run(tiny_run, "rollout.context_mode=last_k", "rollout.keep_last_turns=1")
    # two episodes, three calls each: the third call sees both earlier turns under append, one under last_k
    assert sorted(append.turns_seen()) == [0, 0, 1, 1, 2, 2]
    assert sorted(last_k.turns_seen()) == [0, 0, 1, 1, 1, 1]
    assert max(map(len, last_k.contexts)) < max(map(len, append.contexts))
    assert set(append.temperatures) == set(last_k.temperatures) == {0.0}  # greedy, whatever training sampled at


def test_the_observation_cut_of_training_holds_in_eval(tiny_run):
    full = _agent_run(tiny_run, limit=1)
    cut = _agent_run(tiny_run, "rollout.max_observation_tokens=4", limit=1)
    assert "[truncated]" in cut.texts()[1] and "[truncated]" not in full.texts()[1]
    assert len(cut.contexts[1]) < len(full.contexts[1]) and cut.contexts[0] == full.contexts[0]


def test_eval_settings_build_the_loop_from_the_run_spec():
    config = load_config(TINY, ["rollout.context_mode=last_k", "rollout.max_observation_tokens=7",
                                "rollout.top_p=0.9", "rollout.temperature=0.7"])
    from tasks.evaluate import run_eval_settings

    spec = run_eval_settings(config, greedy=False).spec()
    assert spec == RolloutSpec.from_config(config.rollout).for_eval(greedy=False)
    assert (spec.context.mode, spec.context.max_observation_tokens, spec.top_p, spec.temperature, spec.group_size) == (
        "last_k", 7, 0.9, 0.7, 1)
    loop = spec.loop(policy_version=0)
    assert (loop.max_steps, loop.max_context_tokens, loop.group_size) == (3, 512, 1)
    assert run_eval_settings(config, greedy=True).spec().temperature == 0.0
    assert EvalSettings().spec().context.mode == "append"  # a standalone eval: the full context, as before
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        EvalSettings(scorer="nope")


def test_dev_eval_runs_with_the_training_loop_settings(tiny_run, monkeypatch):
    import agent_core.eval.methods
    from agent_core.config import DevEvalConfig
    from tasks.evaluate import dev_eval, run_eval_settings

    driven = []  # the dev eval's episodes go through the one rollout entry point (and its drivers)
    monkeypatch.setattr(agent_core.eval.methods, "roll_out", lambda *a, **k: driven.append(k["spec"]) or roll_out(*a, **k))

    data_root, dataset, policy_dir = tiny_run
    config = _config(data_root, f"rollout.engine={ENGINE_NAME}", "rollout.context_mode=last_k",
                     "rollout.keep_last_turns=1")
    run = DataRoot(data_root).run("dev-run")
    ENGINES_BUILT.clear()
    uri = dev_eval.fn(run, None, policy_dir, dataset, DevEvalConfig(prompts=2), run_eval_settings(config, greedy=True))
    (engine,) = ENGINES_BUILT
    assert sorted(engine.turns_seen()) == [0, 0, 1, 1, 1, 1]  # last_k, as the run trains
    assert read_table("eval", uri).num_rows == 2
    assert [spec.context.mode for spec in driven] == ["last_k"]
    # the manifest compares the loop settings: the same ones resume, another context mode evaluates again
    assert dev_eval.fn(run, None, policy_dir, dataset, DevEvalConfig(prompts=2),
                       run_eval_settings(config, greedy=True)) == uri and len(ENGINES_BUILT) == 1
    appended = config.model_copy(update={"rollout": config.rollout.model_copy(update={"context_mode": "append"})})
    dev_eval.fn(run, None, policy_dir, dataset, DevEvalConfig(prompts=2), run_eval_settings(appended, greedy=True))
    assert sorted(ENGINES_BUILT[-1].turns_seen()) == [0, 0, 1, 1, 2, 2]


def _custom_env_run(data_root: Path) -> str:
    """A run recorded with the countdown env, the "yes" scorer and last_k (its config only)."""
    config = _config(data_root, f"rollout.engine={ENGINE_NAME}", f"rollout.env={ENV_NAME}",
                     f"reward.scorer={SCORER_NAME}", "rollout.context_mode=last_k", "rollout.keep_last_turns=1",
                     "run_id=custom-env")
    save_config(config, DataRoot(data_root).run("custom-env").config_path)
    return "custom-env"


def _check_custom_env_eval(uri: str) -> None:
    rows = read_table("eval", uri).to_pylist()
    # the countdown env's three steps and answer, scored by the run's scorer (qa_em would give 0, 0)
    assert [(r["prediction"], r["em"], r["f1"], r["steps"], r["termination"]) for r in rows] == [
        ("yes", 1.0, 0.25, 3, "answered")] * 2
    (engine,) = ENGINES_BUILT
    assert sorted(engine.turns_seen()) == [0, 0, 1, 1, 1, 1]  # under last_k


def test_eval_of_a_recorded_run_in_a_custom_env_uses_its_env_scorer_and_context(tiny_run):
    """The settings `agentr1 eval --run-id` derives from the run's recorded config, into the eval task."""
    from flows.configs_lookup import recorded_config
    from tasks.evaluate import evaluate, run_eval_settings

    data_root, dataset, policy_dir = tiny_run
    _, config = recorded_config(str(data_root), _custom_env_run(data_root))
    ENGINES_BUILT.clear()
    _check_custom_env_eval(evaluate.fn(str(data_root), "custom-task", "agent", policy_dir, dataset, "test",
                                       run_eval_settings(config, greedy=True), limit=2))


@pytest.mark.slow  # ~20-30 s on 2 busy cores: the Prefect flow, MLflow and the report
def test_agentr1_eval_of_a_run_in_a_custom_env_uses_its_env_scorer_and_context(tiny_run):
    from flows.deployments import evaluate_training_run

    data_root, dataset, policy_dir = tiny_run
    ENGINES_BUILT.clear()
    result = evaluate_training_run(str(data_root), _custom_env_run(data_root), ["agent"], checkpoint=policy_dir,
                                   seeds=1, limit=2, greedy=True, eval_id="custom-env-eval")
    _check_custom_env_eval(result.table_uris[0])
    assert "| agent | 1 | 1.000 ± 0.000 |" in result.markdown


# A program of env agent_program: one call to the gateway, then "yes" if it was given the corpus.
ONE_CALL = """
import json, os, sys, urllib.request
prompt = json.load(sys.stdin)
request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
    data=json.dumps({"model": "policy", "messages": prompt["messages"]}).encode(),
    headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"})
json.load(urllib.request.urlopen(request))
print(json.dumps({"answer": "yes" if os.path.isfile(os.environ.get("AGENTR1_CORPUS", "")) else "no corpus"}))
"""


def test_eval_of_an_agent_program_run_goes_through_the_gateway_with_its_scorer(tiny_run):
    import sys

    from tasks.evaluate import evaluate, run_eval_settings

    data_root, dataset, policy_dir = tiny_run
    config = _config(data_root, f"rollout.engine={ENGINE_NAME}", f"reward.scorer={SCORER_NAME}")
    program = {"command": [sys.executable, "-c", ONE_CALL], "timeout_s": 60}
    config = config.model_copy(update={"rollout": config.rollout.model_copy(
        update={"env": "agent_program", "env_kwargs": program})})
    ENGINES_BUILT.clear()
    uri = evaluate.fn(str(data_root), "program-eval", "agent", policy_dir, dataset, "dev",
                      run_eval_settings(config, greedy=True), limit=2)
    rows = read_table("eval", uri).to_pylist()
    assert [(r["prediction"], r["em"], r["f1"], r["steps"], r["termination"]) for r in rows] == [
        ("yes", 1.0, 0.25, 1, "answered")] * 2
    (engine,) = ENGINES_BUILT
    assert len(engine.contexts) == 2 and set(engine.temperatures) == {0.0}  # one greedy episode per prompt
