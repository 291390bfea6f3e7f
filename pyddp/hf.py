"""`pyddp.hf`: the transformers Trainer with pyddp wrapping the model. The code and
its docs are in pyddp/integrations/hf.py; this name is the documented import."""

from .integrations.hf import PyddpTrainer

__all__ = ["PyddpTrainer"]
