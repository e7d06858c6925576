"""Backends the product talks to: the in-process engine now; remote servers and routers later.
May import engine and models, never app."""
from chatloom.serving.backend import (Backend, BackendError, BackendNotReady, BackendStats, BadGenerationRequest,
                                      Delta, GenerationRequest, Timings, UnknownModel, Usage)
from chatloom.serving.local import LocalBackend

__all__ = ["Backend", "BackendError", "BackendNotReady", "BackendStats", "BadGenerationRequest", "Delta",
           "GenerationRequest", "Timings", "UnknownModel", "Usage", "LocalBackend"]
