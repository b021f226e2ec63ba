"""The load budget: which drafted nodes a step verifies, over a measured cost model."""
