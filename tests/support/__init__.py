"""Helpers shared by test folders: fake gate and workers, served coordinators."""
