"""Evaluation: methods that answer a split's prompts (agent_core.eval.methods) and the paper-style
report over the `eval` table they fill (agent_core.eval.report). No prefect here (docs/architecture.md §4)."""
