"""Executor: runs a planned strategy as real training steps."""
