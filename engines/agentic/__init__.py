"""Multi-turn agentic RL: the lock-step and asynchronous environment managers, environment workers, tool calls and the environments (envs/)."""
