"""bench/first_answer/: see README.md."""
