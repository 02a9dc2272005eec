"""The contract every splitfeed process shares: the StreamingJob model, the wire messages, the pod
contract, the error tree and the topology math.

Pure: the standard library, numpy and pyarrow only (no zmq, lancedb, kopf or kubernetes), so the
operator, the sidecar, `splitfeed local` and a training script all import it (pyproject.toml
import-linter contracts)."""
