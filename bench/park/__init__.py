"""bench/park/: see README.md."""
