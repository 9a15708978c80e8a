"""Example: an environment without tools, and a scorer, in one file. See docs/guides/write-an-env.md.

The agent guesses a secret number in 1..`high`; the env answers "higher" or "lower". The secret is
the prompt's gold answer, so the problems come from a dataset (examples/guess_number/*.jsonl); the
game ends at the right number or after `max_guesses` guesses, and the scorer `closest_guess` rewards
the last guess by how close it is. Any text env fits the same protocol: `reset(prompt)` opens the
conversation, `step(action_text)` answers.

Use it in a run, from the checkout's root (the guide's command; tests/test_guides.py runs it as written):
    agentr1 train --config tiny --config examples/guess_number.yaml
"""

import re

from agent_core.envs.base import EnvStep
from agent_core.envs.registry import ENVS
from agent_core.rewards.scorers import SCORERS, Score
from agent_core.types import ChatMessage, Prompt

_NUMBER = re.compile(r"-?\d+")


class GuessNumberEnv:
    observation_role = "user"  # the chat role the env's answers are rendered as

    def __init__(self, high: int = 16, max_guesses: int = 4, step_penalty: float = 0.05):
        if high < 2 or max_guesses < 1:
            raise ValueError(f"guess_number: high must be >= 2 and max_guesses >= 1, got {high} and {max_guesses}")
        self.high, self.max_guesses, self.step_penalty = high, max_guesses, step_penalty
        self.secret = self.guesses = 0

    def reset(self, prompt: Prompt) -> tuple[ChatMessage, ...]:
        self.secret, self.guesses = _secret_of(prompt, self.high), 0
        rules = (f"I am thinking of a number from 1 to {self.high}. Reply with one number per turn; I say higher or "
                 f"lower. You have {self.max_guesses} guesses.")
        return (ChatMessage("system", rules), *prompt.messages)

    def step(self, action_text: str) -> EnvStep:
        match = _NUMBER.search(action_text)
        if match is None:  # a bad action is data: say so, penalise, go on
            return EnvStep(observation="Reply with a number.", reward=-self.step_penalty, done=False,
                           parse_error="no number in the reply", info={"format_ok": False})
        guess = int(match.group())
        self.guesses += 1
        if guess == self.secret or self.guesses >= self.max_guesses:
            # The game is over and the last guess is the final answer: the scorer (reward.scorer) labels
            # the outcome reward from info["answer"] and the prompt's answers after the rollout.
            return EnvStep(observation="", reward=0.0, done=True, termination="answered",
                           info={"answer": str(guess), "guesses": self.guesses, "format_ok": True})
        hint = "higher" if guess < self.secret else "lower"
        return EnvStep(observation=hint, reward=-self.step_penalty, done=False, info={"guess": guess, "hint": hint})


def _secret_of(prompt: Prompt, high: int) -> int:
    """The prompt's gold answer, a whole number in 1..high (a bad dataset row fails, named)."""
    answer = prompt.answers[0] if prompt.answers else ""
    if not answer.strip().isdigit() or not 1 <= int(answer) <= high:
        raise ValueError(f"guess_number: prompt {prompt.prompt_id!r} needs a whole number from 1 to {high} as its "
                         f"answer (the secret), got {answer!r}")
    return int(answer)


@ENVS.register("guess_number")
def make_guess_number(resources, *, high: int = 16, max_guesses: int = 4, step_penalty: float = 0.05) -> GuessNumberEnv:
    """Factories get the rollout's shared resources (unused here) and the prompt's env kwargs."""
    return GuessNumberEnv(high=high, max_guesses=max_guesses, step_penalty=step_penalty)


@SCORERS.register("closest_guess")
def closest_guess(final_answer: str | None, answers, *, format_weight: float) -> Score:
    """outcome = 1 / (1 + |guess - secret|) + format_weight * format: 1 for the secret, partial credit
    for a near miss (a denser signal than exact match). em: the secret was found; f1 reports the same."""
    guess = final_answer.strip() if final_answer is not None else ""
    if not guess.lstrip("-").isdigit():  # no answer (the episode ran out of steps) or not a number
        return Score(outcome=0.0, em=0.0, f1=0.0, format_score=0.0, components={"closeness": 0.0, "format": 0.0})
    closeness = 1.0 / (1.0 + abs(int(guess) - int(answers[0])))
    hit = float(closeness == 1.0)
    return Score(outcome=closeness + format_weight, em=hit, f1=hit, format_score=1.0,
                 components={"closeness": closeness, "format": 1.0})
