"""The sidecar's data in the reference order: StreamingDataset's order and state, a rank's reads
(reading), the skips and their ledgers, positions, the resume choice, transforms and batches."""
