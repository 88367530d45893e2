"""bench/step_roofline/: see README.md."""
