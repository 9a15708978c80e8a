"""The built-in behaviour checks: each a name, one read-only SELECT over the run's views returning
(iteration, value), and bounds (agent_core/config/audit.py CheckBounds: absolute max/min, and
max_ratio/min_ratio against the mean of the run's first iterations).

Defaults let the demo recipe (configs/demo.yaml) train without an alert; each check names a failure
RL users report, over a whole iteration so one bad episode does not alert. A ratio cannot see
behaviour bad from the start, so what a policy can show from iteration 0 has an absolute bound too.
What each watches and why: docs/guides/watch-your-agent.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from agent_core.config.audit import BOUND_KEYS, AuditConfig, CheckBounds


@dataclass(frozen=True)
class Check:
    name: str
    sql: str  # one SELECT returning (iteration, value), one row per iteration
    description: str
    max: float | None = None
    min: float | None = None
    max_ratio: float | None = None
    min_ratio: float | None = None
    source: str = "builtin"  # builtin | user
    needs_tools: bool = False  # not run for an env that offers the policy no tools

    def rule(self) -> str:
        """The bounds as text, e.g. `max 0.5, min_ratio 0.25`."""
        bounds = [f"{key} {getattr(self, key):g}" for key in BOUND_KEYS if getattr(self, key) is not None]
        return ", ".join(bounds) or "none"


_ANSWERS = """answers AS (
    SELECT iteration, episode_id, step_idx, lower(trim(json_extract_string(info, '$.answer'))) AS answer
    FROM steps WHERE termination = 'answered')"""
# The scorer's task metric: f1 for qa_f1, em otherwise; the rest of the reward is format and process terms.
_EXTRA_REWARD = """episodes AS (
    SELECT iteration, episode_id, sum(reward) AS reward,
           sum(reward) - coalesce(max(CASE WHEN scorer = 'qa_f1' THEN f1 ELSE em END), 0) AS extra
    FROM rewards GROUP BY iteration, episode_id)"""
_UPDATES = "FROM train_metrics WHERE NOT skipped GROUP BY iteration"

BUILTIN_CHECKS: tuple[Check, ...] = (
    Check("failed_episode_rate",
          "SELECT iteration, avg(CASE WHEN termination = 'error' THEN 1.0 ELSE 0.0 END) AS value FROM steps "
          "WHERE done GROUP BY iteration",
          "share of episodes that ended in an error (an agent program that crashed, hung or made no call; an env "
          "that raised): infrastructure, not the policy; left out of training by default (algorithm.failed_episodes)",
          max=0.2),
    Check("malformed_action_rate",
          "SELECT iteration, avg(CASE WHEN parse_error IS NULL THEN 0.0 ELSE 1.0 END) AS value FROM steps GROUP BY iteration",
          "share of actions the env could not parse (malformed tool calls, neither a call nor an answer)",
          max=0.6),
    Check("tool_error_rate",
          """WITH calls AS (SELECT iteration, unnest(CAST(json_extract(tool_calls, '$[*].ok') AS BOOLEAN[])) AS ok FROM steps)
          SELECT iteration, avg(CASE WHEN ok THEN 0.0 ELSE 1.0 END) AS value FROM calls WHERE ok IS NOT NULL
          GROUP BY iteration""",
          "share of tool calls that failed (unknown tool, bad arguments, a tool error or timeout, over budget; "
          "behind the gateway, from the tool messages the agent sends back)",
          max=0.5, needs_tools=True),
    Check("tool_calls_per_episode",
          """SELECT iteration, sum(json_array_length(tool_calls))::DOUBLE / count(DISTINCT episode_id) AS value
          FROM steps GROUP BY iteration""",
          "tool calls per episode: an agent that (almost) never uses its tools, from the start or after a "
          "collapse, or runaway growth; not run for an env that offers no tools",
          min=0.1, min_ratio=0.25, max_ratio=4.0, needs_tools=True),
    Check("unanswered_episode_rate",
          """SELECT iteration, avg(CASE WHEN truncated THEN 1.0 ELSE 0.0 END) AS value FROM steps
          WHERE done AND termination <> 'error' GROUP BY iteration""",
          "share of episodes (failed ones aside) cut off by a budget (max_steps, max_context) before an "
          "answer: an agent that searches on and never answers",
          max=0.5),
    Check("cut_action_rate",
          "SELECT iteration, avg(CASE WHEN finish_reason = 'length' THEN 1.0 ELSE 0.0 END) AS value FROM steps "
          "WHERE finish_reason <> 'none' GROUP BY iteration",
          "share of actions cut by the token limit (rollout.max_new_tokens) before they ended: rambling, "
          "or a limit too small for the agent's calls",
          max=0.5),
    Check("steps_per_episode",
          "SELECT iteration, count(*)::DOUBLE / count(DISTINCT episode_id) AS value FROM steps GROUP BY iteration",
          "agent steps (turns) per episode: collapse or runaway growth",
          min_ratio=0.5, max_ratio=3.0),
    Check("answer_copied_from_question",
          f"""WITH {_ANSWERS}
          SELECT a.iteration, avg(CASE WHEN length(a.answer) >= 3 AND contains(lower(p.messages), a.answer)
                                  THEN 1.0 ELSE 0.0 END) AS value
          FROM answers a JOIN steps s USING (iteration, episode_id, step_idx)
          JOIN prompts p ON p.prompt_id = s.prompt_id AND p.iteration = s.iteration GROUP BY a.iteration""",
          "share of final answers found in the prompt's own text (copying the question instead of "
          "finding the answer; raise it for data whose answers are named in the question, e.g. comparisons)",
          max=0.5),
    Check("answer_repeats_observation",
          f"""WITH {_ANSWERS}, previous AS (
              SELECT iteration, episode_id, step_idx,
                     lower(trim(lag(observation_text) OVER (PARTITION BY episode_id ORDER BY step_idx))) AS observation
              FROM steps)
          SELECT a.iteration, avg(CASE WHEN length(a.answer) >= 8 AND p.observation IS NOT NULL
                                       AND contains(p.observation, a.answer)
                                       AND length(a.answer) >= 0.5 * length(p.observation) THEN 1.0 ELSE 0.0 END) AS value
          FROM answers a JOIN previous p USING (iteration, episode_id, step_idx) GROUP BY a.iteration""",
          "share of final answers that repeat most of the observation before them (dumping a tool result as the answer)",
          max=0.3),
    Check("repeated_action_rate",
          """WITH ordered AS (
              SELECT iteration, response_text,
                     lag(response_text) OVER (PARTITION BY episode_id ORDER BY step_idx) AS previous FROM steps)
          SELECT iteration, avg(CASE WHEN response_text = previous THEN 1.0 ELSE 0.0 END) AS value
          FROM ordered WHERE previous IS NOT NULL GROUP BY iteration""",
          "share of actions identical to the episode's previous action (a loop of the same call)",
          max=0.5),
    Check("token_repetition_rate",
          """SELECT iteration, avg(CASE WHEN len(response_ids) >= 8
                                   AND len(list_distinct(response_ids)) < 0.3 * len(response_ids)
                                   THEN 1.0 ELSE 0.0 END) AS value FROM steps GROUP BY iteration""",
          "share of actions of 8+ tokens made of under 30% distinct tokens (degenerate repetition)",
          max=0.2),
    Check("response_length",
          "SELECT iteration, avg(len(response_ids))::DOUBLE AS value FROM steps GROUP BY iteration",
          "mean tokens per action: collapse or explosion against the run's start",
          min_ratio=0.33, max_ratio=3.0),
    Check("format_process_reward",
          f"WITH {_EXTRA_REWARD} SELECT iteration, avg(extra) AS value FROM episodes GROUP BY iteration",
          "mean reward per episode beyond the task metric (em, f1 for qa_f1): what the format and "
          "process terms pay; high means well-formed wrong answers pay",
          max=0.5),
    Check("format_process_share",
          f"""WITH {_EXTRA_REWARD}
          SELECT iteration, sum(extra) / nullif(sum(abs(reward)), 0) AS value FROM episodes GROUP BY iteration""",
          "share of the reward from the format and process terms against the outcome term: rising "
          "means the reward rises while the task metric does not",
          max_ratio=2.5),
    Check("entropy",
          f"SELECT iteration, avg(entropy) AS value {_UPDATES}",
          "policy entropy on the trained tokens (train_metrics): collapse against the run's start",
          min_ratio=0.2),
    Check("kl",
          f"SELECT iteration, avg(kl) AS value {_UPDATES}",
          "KL to the reference policy (train_metrics; 0 when none is computed): spikes",
          max=1.0),
    Check("clipfrac",
          f"SELECT iteration, avg(clipfrac) AS value {_UPDATES}",
          "share of tokens whose ratio was clipped (train_metrics): spikes mean too large updates",
          max=0.4),
    Check("learning_signal_rate",
          """SELECT iteration, avg(CASE WHEN list_max(list_transform(advantages, lambda a: abs(a))) > 1e-6
                                   THEN 1.0 ELSE 0.0 END) AS value FROM advantages GROUP BY iteration""",
          "share of trained steps with a non-zero advantage, the only ones RL learns from: 0 means every "
          "group's samples scored alike (all wrong, or all right) and the update only moves the policy by "
          "its regularisers (a warm start too weak or too strong, a reward that cannot tell samples apart)",
          min=0.01),
    Check("nonfinite_updates",
          """SELECT iteration, count(*) FILTER (WHERE skip_reason ILIKE '%non-finite%'
                                          OR NOT isfinite(loss) OR NOT isfinite(grad_norm))::DOUBLE AS value
          FROM train_metrics GROUP BY iteration""",
          "updates with a non-finite loss or gradient (skipped by the trainer): any is an alert",
          max=0.0),
    Check("skipped_update_rate",
          "SELECT iteration, avg(CASE WHEN skipped THEN 1.0 ELSE 0.0 END) AS value FROM train_metrics GROUP BY iteration",
          "share of the iteration's updates skipped (no gradient signal, non-finite values)",
          max=0.75),
)
BUILTIN_NAMES = tuple(check.name for check in BUILTIN_CHECKS)


def _bounded(check: Check, bounds: CheckBounds) -> Check:
    return replace(check, **{key: getattr(bounds, key) for key in BOUND_KEYS if key in bounds.model_fields_set})


def configured_checks(cfg: AuditConfig, offers_tools: bool = True) -> list[Check]:
    """The checks `cfg` runs: the built-ins with their threshold overrides (those not disabled, and
    those about tools only where the env offers some), then the user's."""
    checks = []
    for check in BUILTIN_CHECKS:
        bounds = cfg.thresholds.get(check.name)
        if check.needs_tools and not offers_tools:
            continue
        if bounds is None:
            checks.append(check)
        elif bounds.enabled:
            checks.append(_bounded(check, bounds))
    for user in cfg.checks:
        if user.enabled:
            checks.append(Check(user.name, user.sql, user.description or "user-defined check", user.max, user.min,
                                user.max_ratio, user.min_ratio, source="user"))
    return checks
