"""What every test tier shares, in one copy: ports, waits, tables and their reference
order, manifests, the real control plane, child-process and leak guards.

No tier imports another tier's helpers; each imports these (docs/testing.md).
"""
