"""The simulated multi-node cluster (sim.py), its stand-in tools (standin.py) and scenarios (scenarios.py)."""
