"""Client SDK."""
