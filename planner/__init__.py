"""Shardwise planner: rules, search space, partition solver, plan files, API and CLI."""

__all__ = ["plan", "plan_model"]


def __getattr__(name: str):
    # Imported on first use: `shardwise --help` must not pay for the search and its solver.
    if name in __all__:
        from planner import api

        return getattr(api, name)
    raise AttributeError(f"module 'planner' has no attribute {name!r}")
