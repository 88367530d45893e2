"""bench/prefix_attention/: see README.md."""
