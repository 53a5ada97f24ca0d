"""The local runtime's pieces: process supervision, run directory, live progress, final report and plot.

Shared by `diloco local` and `diloco baseline` so both leave the same kind of run directory.
"""
