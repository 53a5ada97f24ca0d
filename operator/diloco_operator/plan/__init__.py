"""Pure decisions (no I/O): from a job's or a unit's spec and what was observed to what should exist and its status."""
