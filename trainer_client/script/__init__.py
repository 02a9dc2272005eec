"""The training script's library: `StreamClient` and what it is built from (the handshake, the
receiving loop, checkpoints, preemption), the adapters' base and `splitfeed run`'s agent.

Nothing outside trainer_client imports it: the operator, the sidecar and local mode see only
the contract and the transport (pyproject.toml import-linter contracts)."""
