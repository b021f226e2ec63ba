"""The project's benchmark tools, one module each, run as
``vllm-adaptive-spec bench <tool>`` (``benchmarks/bench.py`` lists them) or
``python -m benchmarks.<module>``; how to read and reproduce them:
docs/benchmarking.md."""
