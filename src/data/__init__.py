"""Datasets. Add yours as a DataModule subclass here and give it a config under config/data/."""
