"""bench/common/: see README.md."""
