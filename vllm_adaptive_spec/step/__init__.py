"""The engine step apart from vLLM: proposing the step's trees, its layout
and the rows it publishes, a model drafter's tree layers, acceptance on its
way to the host, the step's counters and what a failure costs. The adapter's
hooks (``adapter/runner.py``) call these in the step's order; nothing here
imports the adapter or vLLM."""
