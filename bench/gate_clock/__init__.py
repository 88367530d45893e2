"""bench/gate_clock/: see README.md."""
