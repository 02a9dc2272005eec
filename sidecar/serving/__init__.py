"""Serving a pod's ranks: publishing batches into their rings, answering their requests,
following the coordinator, and the metrics read from both."""
