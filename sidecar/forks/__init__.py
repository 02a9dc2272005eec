"""Processes forked after the imports: the fork server, the sidecar's build helper, the planner
child and the loader workers that read a rank's splits."""
