"""bench/weights/: see README.md."""
