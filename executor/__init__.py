"""Executor: runs a planned strategy as real training steps; `auto_parallelize` turns a
user's model into a parallel trainer."""

from executor.auto import auto_parallelize

__all__ = ["auto_parallelize"]
