"""What the operator builds and checks: the world's pods and services, network policies,
admission, conditions and status views. Pure."""
