"""`met bench latency|throughput|serve`: vLLM's benchmark names, each printed beside the
hardware floor of the same run (docs/benchmarks.md)."""
