"""Backends the product talks to: the in-process engine, a remote OpenAI-compatible server, the router
over several replicas (policies, health, failover), several models behind one backend, and the
replica's own HTTP face (replica_server.py). May import engine and models, never app."""
from chatloom.serving.backend import (Backend, BackendError, BackendNotReady, BackendStats, BadGenerationRequest,
                                      Delta, EmbedInput, Embeddings, GenerationRequest, ModelLoadFailed, Timings,
                                      UnknownModel, Usage)
from chatloom.serving.local import LocalBackend
from chatloom.serving.multi_model import MultiModelBackend
from chatloom.serving.remote import RemoteBackend, ReplicaError
from chatloom.serving.router import Router, RouterConfig
# Output constraints travel on GenerationRequest; the app builds them without reaching into the engine.
from chatloom.engine.structured.constraint import Constraint, ConstraintError

__all__ = ["Backend", "BackendError", "BackendNotReady", "BackendStats", "BadGenerationRequest", "Delta",
           "EmbedInput", "Embeddings", "GenerationRequest", "ModelLoadFailed", "Timings", "UnknownModel", "Usage", "LocalBackend", "MultiModelBackend",
           "RemoteBackend", "ReplicaError", "Router", "RouterConfig", "Constraint", "ConstraintError"]
