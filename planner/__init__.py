"""Shardwise planner: rules, search space, partition solver, plan files, API and CLI."""

from planner.api import plan, plan_model

__all__ = ["plan", "plan_model"]
