"""`pyddp.lightning`: registers the strategy "pyddp" with Lightning and Fabric. The
code and its docs are in pyddp/integrations/lightning.py; this name is the
documented import."""

from .integrations.lightning import NAME, PyddpFabricStrategy, PyddpStrategy, register

__all__ = ["NAME", "PyddpFabricStrategy", "PyddpStrategy", "register"]
