"""bench/pool/: see README.md."""
