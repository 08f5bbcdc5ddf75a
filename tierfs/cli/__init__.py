"""The tierfs admin CLI."""
