"""The serve-load benchmark's parts (``benchmarks/serve_load.py`` is the tool)."""
