"""Chaos tooling for Decoupled DiLoCo: fault injection, goodput measurement, and the goodput simulator."""
