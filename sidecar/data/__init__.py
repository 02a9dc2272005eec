"""The sidecar's data: the table, its plans, the reads that follow StreamingDataset's order, and
positions in it. The only code that imports lancedb (reading, plans)."""
