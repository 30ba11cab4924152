"""Compatibility layers that let other frameworks' code run on rollout_trio (see docs/areal.md)."""
