"""Prompt tables: loading and validation, sources (synthetic, reasoning-gym, HumanEval, IFEval), the eval split and domain mix, fingerprints, the rollout table's columns."""
