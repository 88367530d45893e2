"""bench/a2a/: see README.md."""
