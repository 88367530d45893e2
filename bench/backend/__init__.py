"""bench/backend/: see README.md."""
