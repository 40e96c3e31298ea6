"""pdcoord: what masters and node agents share (wire stubs, etcd layout and adapter, helpers)."""

__version__ = "0.1.0"
