"""The numerics gates: the three-step RL protocol, run records, the six gates, flag contracts, tolerance reports, CLI."""
