"""Workflows built on the search: `replan` (the same job on another size or cluster) and
`sweep` (the same job over a range of sizes, for capacity planning).
"""
