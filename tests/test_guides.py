"""The guides work when followed literally.

Their examples run: a tool in one file (examples/unit_convert_tool.py) and an env with its scorer
and dataset (examples/guess_number_env.py, examples/guess_number/), each registered by a plugin
import and used by name. And their commands run as written: every ```bash block of each guide (and
the README's tool_env example) is read from the markdown, continuation lines joined, and each
command run by the shell's rules (`shlex`), `agentr1` / `.venv/bin/agentr1` being this
environment's. The working folder stands for the checkout's root, where the guides say to run
them: a fresh temporary folder holding `examples/` (a link to the checkout's), so each run's
`./data` is its own. The fast test checks every command (`agentr1 train --dry-run`, the parser for
the others); the slow one runs them and looks at what they made.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from agent_core.config import ConfigError
from agent_core.envs.registry import ENVS, EnvResources, make_env
from agent_core.envs.tools import TOOLS
from agent_core.io.checkpoints import load_tokenizer
from agent_core.io.layout import DataRoot
from agent_core.io.tables import read_table, write_table
from agent_core.plugins import load_plugins
from agent_core.rewards.scorers import SCORERS
from agent_core.rollout.agent_loop import LoopSettings, run_episodes
from agent_core.rollout.chat import eos_token_ids
from agent_core.rollout.engine import SamplingParams
from agent_core.rollout.hf_engine import HFEngine
from agent_core.training.model import build_tiny_policy, build_tokenizer
from agent_core.types import ChatMessage, Prompt
from agent_core.validation import build_config
from flows.cli import _parser
from flows.cli import main as cli_main

REPO_ROOT = Path(__file__).resolve().parent.parent
GUIDES = REPO_ROOT / "docs" / "guides"
# doc -> (markdown file, text a ```bash block must contain to be taken; None: every block)
DOCS = {
    "write-a-tool": (GUIDES / "write-a-tool.md", None),
    "write-an-env": (GUIDES / "write-an-env.md", None),
    "train-your-agent": (GUIDES / "train-your-agent.md", None),
    "readme-tool-env": (REPO_ROOT / "README.md", "rollout.env=tool_env"),
}
AGENTR1_SPELLINGS = ("agentr1", ".venv/bin/agentr1")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module", autouse=True)
def plugins():
    load_plugins(["examples.unit_convert_tool", "examples.guess_number_env"])


def _prompt(question: str, env: str, answer: str = "x") -> Prompt:
    return Prompt("p0", "guide", "train", (ChatMessage("user", question),), (answer,), env)


# ---- the commands, as the markdown has them -------------------------------------------------------


def fenced_blocks(markdown: str, language: str) -> list[str]:
    return [body for lang, body in _FENCE.findall(markdown) if lang == language]


def bash_commands(markdown: str, containing: str | None = None) -> list[list[str]]:
    """The commands of the ```bash blocks (those containing `containing`), as the shell splits them:
    backslash-newline joins lines, `#` starts a comment, blank lines are skipped."""
    commands = []
    for block in fenced_blocks(markdown, "bash"):
        if containing is not None and containing not in block:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            if argv := shlex.split(line, comments=True):
                commands.append(argv)
    return commands


def doc_commands(doc: str) -> list[list[str]]:
    path, containing = DOCS[doc]
    commands = bash_commands(path.read_text(), containing)
    assert commands, f"{path}: no ```bash commands found"
    for argv in commands:
        assert argv[0] in AGENTR1_SPELLINGS, f"{path}: a command this test cannot run as written: {shlex.join(argv)}"
    return commands


def checkout_like(folder: Path) -> Path:
    """A working folder as the guides assume it (the checkout's root: `examples/` in it) whose ./data
    is its own."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "examples").symlink_to(REPO_ROOT / "examples", target_is_directory=True)
    return folder


def test_commands_are_read_as_the_shell_reads_them():
    markdown = "text\n```bash\nagentr1 train --set 'a={b: [c, d]}' \\\n  --set x=1   # comment\n\nagentr1 runs\n```\n" \
               "```python\nagentr1 no\n```\n"
    assert bash_commands(markdown) == [["agentr1", "train", "--set", "a={b: [c, d]}", "--set", "x=1"], ["agentr1", "runs"]]
    assert bash_commands(markdown, containing="nothing") == []


@pytest.mark.parametrize("doc", DOCS)
def test_guide_commands_check_as_written(doc, tmp_path, monkeypatch, capsys):
    """Every command parses; every `agentr1 train` passes its config check (`--dry-run`) from a
    checkout-like folder, writing nothing."""
    monkeypatch.chdir(checkout_like(tmp_path / "work"))
    for argv in doc_commands(doc):
        args = _parser().parse_args(argv[1:])
        if args.command == "train":
            code = cli_main([*argv[1:], "--dry-run"])
            assert code == 0, f"{shlex.join(argv)} --dry-run: {capsys.readouterr().err}"
    assert not (tmp_path / "work" / "data").exists()


def test_the_tool_guide_on_the_default_config_is_refused_before_anything_runs(tmp_path, monkeypatch, capsys):
    """What the user of issue 18 ran: the tool guide's env without `--config tiny`, so with the default
    warm start, whose oracle calls `search`: refused at the config check, naming the tools and fixes."""
    monkeypatch.chdir(checkout_like(tmp_path / "work"))
    code = cli_main(["train", "--set", "plugins=[examples.unit_convert_tool]", "--set", "rollout.env=tool_env",
                     "--set", "rollout.env_kwargs={tools: [unit_convert, calculator], tool_format: hermes}"])
    error = capsys.readouterr().err
    assert code == 2 and "scripted oracle calls tool(s) search" in error
    assert "its tools: unit_convert, calculator" in error and "--set warm_start.enabled=false" in error
    assert not (tmp_path / "work" / "data").exists()


def test_the_guides_python_imports_resolve():
    """Each import line of a guide's ```python blocks imports what it names."""
    for guide in sorted(GUIDES.glob("*.md")):
        for block in fenced_blocks(guide.read_text(), "python"):
            for line in block.splitlines():
                if line.startswith(("from ", "import ")):
                    exec(line, {})  # noqa: S102 - the guide's own import line


# ---- the commands, run ------------------------------------------------------------------------------


def _environment(folder: Path) -> dict[str, str]:
    """A user's shell: no Prefect or agentr1 settings of this test session, but this session's
    Prefect API (a temporary one per command costs ~20 s to start; kill_harness.run_cli does the same)."""
    from kill_harness import prefect_api_url

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "AGENTR1_", "MLFLOW_"))}
    env.update(PREFECT_HOME=str(folder / ".prefect"), PREFECT_API_URL=prefect_api_url(),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_LOGGING_TO_API_ENABLED="false")
    return env


def _run_as_written(argv: list[str], folder: Path) -> str:
    agentr1 = Path(sys.executable).parent / "agentr1"
    program = [str(agentr1)] if agentr1.is_file() else [sys.executable, "-m", "flows.cli"]
    done = subprocess.run([*program, *argv[1:]], cwd=folder, env=_environment(folder), capture_output=True,
                          text=True, timeout=500)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{shlex.join(argv)} exited {done.returncode}:\n{output[-4000:]}"
    return done.stdout


def _only_run(folder: Path):
    (run,) = (DataRoot(folder / "data").run(path.name) for path in (folder / "data" / "runs").iterdir())
    return run


def _check_tool_guide(folder: Path, outputs: list[str]) -> None:
    """The policy was shown both tools (the system prompt of every first step lists their schemas),
    and the query printed what it wrote and how the env read it."""
    run = _only_run(folder)
    steps = read_table("steps", run.table_uri(0, "steps")).to_pylist()
    tokenizer = load_tokenizer(run.initial_policy_dir)
    for step in (s for s in steps if s["step_idx"] == 0):
        opening = tokenizer.decode(step["prompt_ids"])
        assert '"name": "unit_convert"' in opening and '"name": "calculator"' in opening
    calls = [call for s in steps for call in json.loads(s["tool_calls"])]  # a tiny policy rarely makes one
    assert all(c["name"] in {"unit_convert", "calculator"} or c["error_kind"] == "unknown_tool" for c in calls)
    assert "response_text" in outputs[1] and "parse_error" in outputs[1]


def _check_env_guide(folder: Path, outputs: list[str]) -> None:
    """The jsonl dataset, the plugin's env and its scorer made the run's tables."""
    run = _only_run(folder)
    prompts = read_table("prompts", run.table_uri(0, "prompts")).to_pylist()
    assert all(p["prompt_id"].startswith("train-") and json.loads(p["env"])["name"] == "guess_number" for p in prompts)
    steps = read_table("steps", run.table_uri(0, "steps")).to_pylist()
    infos = [json.loads(s["info"]) for s in steps]
    assert any("hint" in i or "guesses" in i or i.get("format_ok") is False for i in infos)
    rewards = read_table("rewards", run.table_uri(1, "rewards")).to_pylist()
    assert {r["scorer"] for r in rewards} == {"closest_guess"}
    assert all("closeness" in json.loads(r["components"]) for r in rewards if r["em"] is not None)
    assert "episodes" in outputs[1] and "outcome" in outputs[1]


def _check_readme_tool_env(folder: Path, outputs: list[str]) -> None:
    run = _only_run(folder)
    assert "tool_env" in run.config_path.read_text()
    assert "termination" in outputs[1] and "(0 rows)" not in outputs[1]


def _check_agent_guide(folder: Path, outputs: list[str]) -> None:
    """The example agent ran through the gateway: every step a recorded call, each episode ended
    answered, truncated or failed with its reason, and the second iteration trained on the first."""
    run = _only_run(folder)
    for iteration in (0, 1):
        steps = read_table("steps", run.table_uri(iteration, "steps")).to_pylist()
        infos = [json.loads(s["info"]) for s in steps]
        assert steps and all(info["gateway"] for info in infos)
        assert len({s["episode_id"] for s in steps}) == 6  # 3 prompts x group_size 2 (configs/tiny.yaml)
        ends = [(step, info) for step, info in zip(steps, infos) if step["done"]]
        assert all("answer" in info or "error" in info or step["truncated"] for step, info in ends), ends
        # the program itself worked (openai client, gateway, answer line): not every episode a failure
        assert any("error" not in info for _, info in ends), [info["error"] for _, info in ends]
    assert "termination" in outputs[1] and "episode_id" in outputs[2]


CHECKS = {"write-a-tool": _check_tool_guide, "write-an-env": _check_env_guide, "readme-tool-env": _check_readme_tool_env,
          "train-your-agent": _check_agent_guide}


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_guide_commands_run_as_written(doc, tmp_path):
    folder = checkout_like(tmp_path / "work")
    outputs = [_run_as_written(argv, folder) for argv in doc_commands(doc)]
    CHECKS[doc](folder, outputs)


# ---- the tool example ---------------------------------------------------------------------------


def test_guides_name_their_example_files():
    assert "examples/unit_convert_tool.py" in (GUIDES / "write-a-tool.md").read_text()
    env_guide = (GUIDES / "write-an-env.md").read_text()
    for name in ("examples/guess_number_env.py", "examples/guess_number.yaml", "examples/guess_number/train.jsonl"):
        assert name in env_guide and (REPO_ROOT / name).is_file()


def test_tool_example_is_registered_with_the_schema_from_its_docstring():
    assert "unit_convert" in TOOLS.names()
    spec = TOOLS.get("unit_convert")(EnvResources()).spec()["function"]
    assert spec["description"] == "Convert a length from one unit to another."
    assert spec["parameters"]["required"] == ["value", "source", "target"]
    assert spec["parameters"]["properties"]["source"] == {
        "type": "string", "enum": ["m", "km", "mi", "ft"], "description": "The unit `value` is in."}


def test_tool_example_runs_in_tool_env_and_bad_calls_are_observations():
    env = make_env("tool_env", {"tools": ["unit_convert", "calculator"], "tool_format": "hermes"}, EnvResources())
    opening = env.reset(_prompt("How many km is a mile?", "tool_env"))
    assert "unit_convert" in opening[0].content  # the tool list is in the system prompt
    call = '<tool_call>{"name": "unit_convert", "arguments": {"value": 1, "source": "mi", "target": "km"}}</tool_call>'
    step = env.step(call)
    assert "1.60934 km" in step.observation and step.tool_calls[0].ok and not step.done
    bad = env.step('<tool_call>{"name": "unit_convert", "arguments": {"value": 1, "source": "yd", "target": "m"}}</tool_call>')
    assert not bad.tool_calls[0].ok and bad.tool_calls[0].error_kind == "bad_arguments" and "source" in bad.observation
    assert env.step("<answer>1.609 km</answer>").termination == "answered"


def test_tool_example_cannot_use_the_tag_format_and_says_why():
    with pytest.raises(ValueError, match="unit_convert"):
        make_env("tool_env", {"tools": ["unit_convert"], "tool_format": "tag"}, EnvResources())


# ---- the env example ------------------------------------------------------------------------------


def test_env_example_binary_search_wins_and_the_scorer_labels_it():
    env = make_env("guess_number", {"high": 64, "max_guesses": 7}, EnvResources())
    env.reset(_prompt("Guess.", "guess_number", answer="37"))
    low, high, steps = 1, 64, 0
    while True:
        guess = (low + high) // 2
        step, steps = env.step(f"My guess is {guess}."), steps + 1
        if step.done:
            break
        low, high = (guess + 1, high) if step.observation == "higher" else (low, guess - 1)
    assert step.termination == "answered" and step.info["answer"] == "37" and steps <= 7
    assert env.step("no idea").parse_error == "no number in the reply"
    score = SCORERS.get("closest_guess")
    assert score("37", ["37"], format_weight=0.1).em == 1.0
    near = score("35", ["37"], format_weight=0.1)
    assert near.em == 0.0 and near.outcome == pytest.approx(1 / 3 + 0.1)
    assert score(None, ["37"], format_weight=0.1).outcome == 0.0


def test_env_example_ends_after_max_guesses_with_the_last_guess_as_the_answer():
    env = make_env("guess_number", {"high": 8, "max_guesses": 2}, EnvResources())
    env.reset(_prompt("Guess.", "guess_number", answer="8"))
    assert env.step("1").observation == "higher"
    last = env.step("2")
    assert last.done and last.termination == "answered" and last.info["answer"] == "2"
    with pytest.raises(ValueError, match="needs a whole number from 1 to 8"):
        env.reset(_prompt("Guess.", "guess_number", answer="nine"))


def test_env_example_rolls_out_with_a_real_model_into_a_valid_steps_table(tmp_path):
    texts = ["I am thinking of a number from 1 to 8. Reply with one number per turn.", "higher lower 1 2 3 4 5 6 7 8"]
    tokenizer = build_tokenizer(texts, vocab_size=300)
    model = build_tiny_policy(tokenizer, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=0)
    prompts = [_prompt("Guess.", "guess_number", answer="3")]
    settings = LoopSettings(group_size=3, max_steps=3, max_context_tokens=512, policy_version=0)
    sampling = SamplingParams(max_new_tokens=8, stop_token_ids=eos_token_ids(tokenizer), seed=0)
    steps = run_episodes(HFEngine(model, tokenizer), tokenizer, prompts,
                         lambda p: make_env(p.env_name, {"high": 8}, EnvResources()), sampling, settings)
    rows = [{"run_id": "r", "iteration": 0, **dataclasses.asdict(s)} for s in steps]
    table = read_table("steps", write_table("steps", rows, tmp_path / "steps.parquet"))
    assert len(set(table.column("episode_id").to_pylist())) == 3
    assert set(table.column("termination").drop_null().to_pylist()) <= {"answered", "max_steps"}


def test_env_example_is_selectable_by_config_and_typos_list_valid_kwargs():
    base = {"plugins": ["examples.guess_number_env"], "warm_start": {"enabled": False}}
    config = build_config({**base, "rollout": {"env": "guess_number", "env_kwargs": {"high": 8}},
                           "reward": {"scorer": "closest_guess"}})
    assert config.rollout.env == "guess_number" and "guess_number" in ENVS.names()
    with pytest.raises(ConfigError, match=re.escape("valid arguments: high, max_guesses, step_penalty")):
        build_config({**base, "rollout": {"env": "guess_number", "env_kwargs": {"hi": 8}}})
