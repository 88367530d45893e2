"""bench/sampling/: see README.md."""
