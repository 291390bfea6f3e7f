"""pyddp.Trainer: the training loop, its config, callbacks, sharded data,
evaluation, Ctrl-C handling, random streams, loss scaling and checkpoints
(checkpoints/). Imports replicas/ and below, never integrations/."""
