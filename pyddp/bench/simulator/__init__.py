"""The GPU-scaling simulator behind `pyddp-bench simulate`: predicts a
data-parallel training step on 1 to hundreds of GPUs, for each gradient-sync
policy, from a model's gradient ready-time profile, without a GPU.

  costmodel      the Profile (forward, backward and optimizer times, each
                 gradient's size and ready time); `record` logs one step's
                 operators on the meta device, `price` times them on a GPU's
                 roofline, `profile_from_timeline` reads a measured run
  architectures  model presets on meta (ResNet, VGG, Inception, BERT, GPT-2)
  hardware       GPU, node and network presets with their sources, and NCCL's
                 cost model of an all-reduce
  simulate       one step per policy and GPU count (`step`, `sweep`), the chart
  published      the published scaling results reproduced (`--validate`)
  cli            the `simulate` subcommand's options and command

It is fed only by public API: a profile recorded on the meta device
(`costmodel.record`), or one measured from a run through
`GradSync.ready_times()` / `DistributedModel.ready_times()` (a
`pyddp.engine.observe.ReadyTimes`, read by `costmodel.profile_from_timeline`); it
imports nothing from the engine. Import the modules themselves:
`from pyddp.bench.simulator import costmodel, hardware, simulate`."""
