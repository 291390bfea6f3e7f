"""`pyddp.accelerate`: `accelerator.prepare` with pyddp wrapping the model. The
code and its docs are in pyddp/integrations/accelerate.py; this name is the
documented import."""

from .integrations.accelerate import prepare, prepare_model, unwrap

__all__ = ["prepare", "prepare_model", "unwrap"]
