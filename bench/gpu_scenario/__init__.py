"""bench/gpu_scenario/: see README.md."""
