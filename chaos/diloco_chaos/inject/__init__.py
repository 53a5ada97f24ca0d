"""Fault injection: an experiment's description, its schedule and safety guards, the runner, its record and metrics."""
