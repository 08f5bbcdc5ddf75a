"""TierFS KV cache."""
