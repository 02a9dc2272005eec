"""Processes forked after the imports: the sidecar's build helper, the planner child and the
loader workers that read a rank's splits (the forking rule is forking.py's)."""
