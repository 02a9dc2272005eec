"""splitfeed's loader sidecar: reads a rank's splits from LanceDB and fills the ring.

The only layer that imports lancedb (in `reading`), started as `splitfeed sidecar`
in pods and by `splitfeed local` on one machine.
"""
