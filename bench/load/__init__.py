"""bench/load/: see README.md."""
