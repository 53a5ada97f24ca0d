"""The runtime: `diloco local`'s process supervision, run directory, live progress, ledger, final report and plot;
warm spare learners, the warm standby syncer, and `diloco pod-learner` (a learner pod's entrypoint).

Shared by `diloco local` and `diloco baseline` so both leave the same kind of run directory.
"""
