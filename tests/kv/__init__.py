"""Tests of the KV cache (tierfs.kv)."""
