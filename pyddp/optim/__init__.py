"""Optimizers over every replica: the replicated optimizer (one object stepping
every replica) and its sharded variant (ZeRO stage 1, zero), built by the
factory dmodel.optimizer calls. Imports engine/, never replicas/ or train/."""
