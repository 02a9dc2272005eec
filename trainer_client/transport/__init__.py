"""The transport: the shared-memory ring and its slots, and the ZeroMQ pieces every side needs
(the job's CURVE keys, the drain request, a stranded rank's checkpoint request)."""
