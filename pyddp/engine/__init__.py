"""The gradient engine's Python side: GradSync (sync) over the C++ core, its
autograd hooks, bucket layout, stream order, options and statistics, and the
collectives on lists of per-replica tensors. Imports runtime/ and _link/, never
replicas/, optim/, train/ or integrations/."""
