"""Memory, overhead and concurrency benchmarks, with the naive baseline proxy."""
