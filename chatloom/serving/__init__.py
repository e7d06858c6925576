"""Backends the product talks to: the in-process engine, a remote OpenAI-compatible server, the router
over several replicas (policies, health, failover), several models behind one backend, and the
replica's own HTTP face (replica_server.py). May import engine and models, never app."""
from chatloom.lazy_exports import lazy_getattr

# Loaded on first use (PEP 562): the routing policies, which the fleet simulator runs, can be imported
# without the backends (and the engine and torch behind the local one).
_EXPORTS = {**dict.fromkeys(("Backend", "BackendError", "BackendNotReady", "BackendStats", "BadGenerationRequest",
                             "Delta", "EmbedInput", "Embeddings", "GenerationRequest", "ModelLoadFailed", "Timings",
                             "UnknownModel", "Usage"), "chatloom.serving.backend"),
            "LocalBackend": "chatloom.serving.local", "MultiModelBackend": "chatloom.serving.multi_model",
            "RemoteBackend": "chatloom.serving.remote", "ReplicaError": "chatloom.serving.remote",
            "Router": "chatloom.serving.router", "RouterConfig": "chatloom.serving.router",
            # Output constraints travel on GenerationRequest; the app builds them without reaching into the engine.
            "Constraint": "chatloom.engine.structured.constraint",
            "ConstraintError": "chatloom.engine.structured.constraint"}

__all__ = list(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
