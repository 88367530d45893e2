"""bench/demo_transcript/: see README.md."""
