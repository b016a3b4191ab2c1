"""Rewards: the built-in functions (named in config as `rlsys.rewards:exact_match`), how user
functions are loaded (loading), the worker pool that calls them (pool) and remote reward services (remote)."""

from rlsys.rewards.builtin import contains_label, exact_match, last_number_match, math_verify

__all__ = ["contains_label", "exact_match", "last_number_match", "math_verify"]
