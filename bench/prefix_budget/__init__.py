"""bench/prefix_budget/: see README.md."""
