"""The local kit: local etcd, process launcher, ``LocalCluster``, the demo, the protocol model and the
load generator. For development, tests and benchmarks; masters and agents never import it."""
