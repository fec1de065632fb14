"""Rewards at run time: a config's `reward:` spec resolved to a callable (resolve.py: built-ins
by short name, `file.py:fn`, `pkg.module:fn`, a trained reward model via reward_model.py),
wrapped as a ContractReward and run in worker processes with a timeout (pool.py);
`make_reward_pool(config.reward, config.reward_weights, ...)` builds what a workflow awaits.
The contract (the signature, the `Reward` base class) is arealite/api/reward_api.py; the
built-in rewards live with their tasks in arealite/tasks/.

Imports arealite.api, arealite.utils and arealite.tasks (the built-in rewards by short name).
"""

from arealite.reward.resolve import make_reward_pool

__all__ = ["make_reward_pool"]
