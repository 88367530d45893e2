"""bench/bfcl/: see README.md."""
