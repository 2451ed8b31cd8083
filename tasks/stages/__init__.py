"""The Flyte tasks of an iteration, one module per stage (never importing each other), and the fused task that composes them."""
