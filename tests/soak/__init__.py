"""Randomized fault soak (see docs/reliability.md)."""
