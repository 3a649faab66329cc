"""Shardwise cost model: specs, the terms (compute, communication, memory, pipeline) and
`costmodel.estimate.estimate`, which combines them into step time and peak memory.

The bottom layer of Shardwise: pure Python, no solver, no torch.distributed; it imports
nothing of the planner or the executor.
"""
