"""The world life cycle: one pure decision per observation (steady, restarting, rescaling,
in place, ending)."""
