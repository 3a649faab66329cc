"""Shardwise planner: rules, search space, partition solver, plan files, API and CLI."""
