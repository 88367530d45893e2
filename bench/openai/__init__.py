"""bench/openai/: see README.md."""
