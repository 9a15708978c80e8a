"""The behaviour health audit (issue 33): named SQL checks over a run's tables, judged per iteration
against thresholds and the run's first iterations. `BUILTIN_CHECKS` lists them; the config's
`audit:` section (agent_core/config/audit.py) tunes them and adds the user's own."""

from agent_core.audit.checks import BUILTIN_CHECKS, BUILTIN_NAMES, Check, configured_checks
from agent_core.audit.evaluate import FAILING, HealthRow, judge, run_checks
from agent_core.audit.runner import audit_iterations, judged_iterations

__all__ = ["BUILTIN_CHECKS", "BUILTIN_NAMES", "FAILING", "Check", "HealthRow", "audit_iterations",
           "configured_checks", "judge", "judged_iterations", "run_checks"]
