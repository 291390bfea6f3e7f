"""pyddp inside other trainers (Lightning and Fabric, Accelerate, the transformers
Trainer, Ray Train), on their public extension points and pyddp's public API;
imported by name (`import pyddp.lightning`), never by the rest of pyddp."""
