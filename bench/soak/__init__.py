"""bench/soak/: see README.md."""
