"""Engine adapters: thin layers over :mod:`tierfs.kv` that LMCache, SGLang
HiCache and vLLM's KV offloading load by module path (docs/engines.md).

Each adapter imports its engine; this package itself imports none, so the
core install stays free of torch and the engines."""
