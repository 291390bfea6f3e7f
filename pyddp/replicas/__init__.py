"""The wrapped model (`pyddp.wrap`): replicas kept following replica 0, their
worker threads, scatter and gather of batches and outputs, SyncBatchNorm, and
torch's Join for uneven inputs. Imports engine/ and optim/, never train/."""
