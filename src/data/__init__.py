"""Datasets: one DataModule subclass per file (see base.py), each with a config/data/NAME.yaml naming it."""
