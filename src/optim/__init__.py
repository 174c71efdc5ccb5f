"""Optimizers and learning-rate schedules, yours to add to: functions whose signatures are their config
(config/optimizer/, config/scheduler/)."""
