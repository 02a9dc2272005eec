"""The chaos soak: seeded random events on a live `splitfeed local` job, then its invariants (python -m tests.soak)."""
