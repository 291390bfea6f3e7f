"""`pyddp.ray`: `prepare_model` for Ray Train"s training functions. The code and
its docs are in pyddp/integrations/ray.py; this name is the documented import."""

from .integrations.ray import prepare_model

__all__ = ["prepare_model"]
