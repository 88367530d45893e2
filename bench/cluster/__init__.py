"""bench/cluster/: see README.md."""
