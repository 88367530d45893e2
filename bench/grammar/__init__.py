"""bench/grammar/: see README.md."""
