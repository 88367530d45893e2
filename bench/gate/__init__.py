"""bench/gate/: see README.md."""
