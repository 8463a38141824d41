"""Everything that touches sglang internals: the replica, its loader probe, the reload
layout, the process-global state sglang's model code reads, and the reference loading
used by the local engine and verification. ``compat`` checks the symbols relied on."""
