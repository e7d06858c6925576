"""Backends the product talks to: the in-process engine now; remote servers and routers later.
May import engine and models, never app."""
from chatloom.serving.backend import (Backend, BackendError, BackendNotReady, BackendStats, BadGenerationRequest,
                                      Delta, GenerationRequest, Timings, UnknownModel, Usage)
from chatloom.serving.local import LocalBackend
# Output constraints travel on GenerationRequest; the app builds them without reaching into the engine.
from chatloom.engine.structured.constraint import Constraint, ConstraintError

__all__ = ["Backend", "BackendError", "BackendNotReady", "BackendStats", "BadGenerationRequest", "Delta",
           "GenerationRequest", "Timings", "UnknownModel", "Usage", "LocalBackend",
           "Constraint", "ConstraintError"]
