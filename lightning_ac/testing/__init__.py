"""Test doubles that ship with the package, for the suite's tests and for users who test their own transfer code:
:class:`~lightning_ac.testing.simulated.SimulatedDevice`, the device seam on the CPU with a device's hazards."""
