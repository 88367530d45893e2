"""bench/overhead/: see README.md."""
