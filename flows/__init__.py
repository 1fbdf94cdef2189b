"""Prefect flows: declarative chains of the tasks in ``tasks/``."""
