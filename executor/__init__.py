"""Executor: runs a planned strategy as real training steps; `auto_parallelize` turns a
user's model into a parallel trainer.

mesh.py turns a strategy into a DeviceMesh; parallelize.py splits Shardwise's own
Transformer (models.py) into one rank's parts, auto.py a Hugging Face decoder LM; step.py
is the one training step both run through, train.py the one trainer around it; run.py is
the `shardwise run` worker (launch.py reads and checks its plan and starts it, and forks
ranks in-process for tests and benchmarks; checkpoint.py saves and resumes it, data.py
feeds it); measure.py measures this machine for `shardwise profile`; collective_log.py
records the collectives a rank really issued.
"""

__all__ = ["auto_parallelize"]


def __getattr__(name: str):
    # Imported on first use: `import executor.launch` (torchrun's launcher process, the
    # CLI's checks before a run) must not pay for torch and the whole executor.
    if name == "auto_parallelize":
        from executor.auto import auto_parallelize

        return auto_parallelize
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
