"""RL algorithms as pure functions over tensors, chosen by name through registries
(registry.py). Importing the package imports every module that registers a variant, so the
registries are full whichever module a caller imports first. The trainer uses the config bridge
(objective.py); a name is imported from the module that defines it. See docs/algorithms.md.
"""

from engines.algorithms import advantages, critic, gigpo, kl, normalize, policy_losses, shaping  # noqa: F401  (registers)
