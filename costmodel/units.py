"""Units, defined once: byte multiples. Figures carry their unit in their names
(`memory_bytes`, `step_time_s`); these convert them for people."""

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
