"""bench/task_store/: see README.md."""
