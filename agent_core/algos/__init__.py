"""RL algorithms on plain tensors: episodes and masks, rewards, advantage estimators, losses, KL.

Importing the estimator modules here registers every built-in advantage estimator in
``estimator_core.ADVANTAGE_ESTIMATORS`` whichever ``agent_core.algos`` module a caller imports
first (Python runs this file before any submodule), so no module needs a function-level import
to see them and ``estimator_core`` stays the base module that imports none of its estimators.
"""

from agent_core.algos import advantages, estimators_critic, gigpo, gspo  # noqa: F401  (register estimators, losses)
