"""Benchmarks. ``python -m bench`` runs rollout_trio side by side with AReaL 1.0.4."""
