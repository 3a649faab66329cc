"""Executor: runs a planned strategy as real training steps; `auto_parallelize` turns a
user's model into a parallel trainer.

mesh.py turns a strategy into a DeviceMesh; parallelize.py splits Shardwise's own
Transformer (models.py) into one rank's parts, auto.py a Hugging Face decoder LM; step.py
is the one training step both run through, train.py the one trainer around it; run.py is
the `shardwise run` worker (launch.py starts it, checkpoint.py saves and resumes it,
data.py feeds it); measure.py measures this machine for `shardwise profile`;
collective_log.py records the collectives a rank really issued.
"""

from executor.auto import auto_parallelize

__all__ = ["auto_parallelize"]
