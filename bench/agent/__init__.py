"""bench/agent/: see README.md."""
