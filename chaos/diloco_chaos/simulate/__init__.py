"""Simulation at scale, no cluster needed: the goodput simulator, the WAN bandwidth calculator, syncer sizing."""
