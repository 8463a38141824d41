"""A local rollout engine for tests and the demo: sglang's model code and weight-update API
on the CPU, without a GPU sglang server. Production targets stay real sglang servers."""

from p2pweights.local_engine.process import LocalEngine, free_port

__all__ = ["LocalEngine", "free_port"]
