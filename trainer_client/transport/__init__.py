"""The transport: the shared-memory ring and its slots, the trainer's socket to its sidecar
(`channel`), and the ZeroMQ pieces every side needs (the job's CURVE keys, the drain request, a
stranded rank's checkpoint request)."""
