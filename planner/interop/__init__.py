"""Interop with the engines users already run (torchtitan, Megatron-LM, DeepSpeed):
reading their configurations into strategies, writing plans as their configurations,
and evaluating a configuration beside the best plan.
"""
