"""The etcd key layout of one pdcoord cluster (DESIGN §3).

Everything lives under one root, by default ``/pdcoord/<cluster>/``:

* ``masters/<master_id>`` — a master's registration, attached to its lease;
* ``nodes/<node_id>`` — a node agent's registration, attached to its lease;
* ``epochs/<node_id>`` — the last epoch a node agent issued. Deliberately *not* attached to a
  lease: it must outlive an agent whose lease expired so that epochs stay monotonic across
  agent restarts.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "/pdcoord/"
MAX_ID_LENGTH = 128


def validate_id(value: str, what: str = "id") -> str:
    """Return *value* if it is usable as one path segment of an etcd key, else raise ValueError."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise ValueError(
            f"{what} {value[:32]!r}... is {len(value)} characters long; the limit is {MAX_ID_LENGTH}"
        )
    if "/" in value:
        raise ValueError(f"{what} {value!r} must not contain '/'")
    if not value.isprintable():
        raise ValueError(f"{what} {value!r} must consist of printable characters only")
    return value


@dataclass(frozen=True)
class Keys:
    """Key names for one cluster. Build with :meth:`for_cluster`."""

    cluster: str
    root: str

    @classmethod
    def for_cluster(cls, cluster: str, prefix: str | None = None) -> Keys:
        """Keys under ``<prefix><cluster>/``; *prefix* defaults to ``/pdcoord/``."""
        validate_id(cluster, "cluster name")
        base = DEFAULT_PREFIX if prefix is None else prefix
        if not base:
            raise ValueError("key prefix must not be empty")
        if not base.isprintable():
            raise ValueError(f"key prefix {base!r} must be printable")
        if not base.endswith("/"):
            base += "/"
        return cls(cluster=cluster, root=f"{base}{cluster}/")

    @property
    def masters_prefix(self) -> str:
        return self.root + "masters/"

    @property
    def nodes_prefix(self) -> str:
        return self.root + "nodes/"

    @property
    def epochs_prefix(self) -> str:
        return self.root + "epochs/"

    def master(self, master_id: str) -> str:
        return self.masters_prefix + validate_id(master_id, "master id")

    def node(self, node_id: str) -> str:
        return self.nodes_prefix + validate_id(node_id, "node id")

    def epoch(self, node_id: str) -> str:
        return self.epochs_prefix + validate_id(node_id, "node id")

    @staticmethod
    def id_from_key(key: str, prefix: str) -> str:
        """The id segment of *key* directly under *prefix* (e.g. ``masters_prefix``).

        Raises ValueError for a key outside *prefix* or one that is not exactly one segment deeper,
        so a stray key written by hand under the cluster root cannot be mistaken for a member.
        """
        if not key.startswith(prefix):
            raise ValueError(f"key {key!r} is not under {prefix!r}")
        return validate_id(key[len(prefix) :], f"id in key {key!r}")
