"""Objectives, yours to add to: what training minimises and evaluation reports (see base.py); each has a
config/objective/NAME.yaml naming it."""
