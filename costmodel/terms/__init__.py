"""The cost model's terms, pure functions of specs: compute (`compute`), collective cost
(`comm`), memory (`memory`), the pipeline schedule (`pipeline`) and the parameter and
FLOP counts of a model (`counts`). The estimates in `costmodel.estimate` combine them.
"""
