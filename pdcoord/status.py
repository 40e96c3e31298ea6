"""``pdcoord status``: the fleet at a glance, from etcd and every registered master's ``/admission``.

One look reads the cluster's keys in etcd (``masters/``, ``nodes/``, ``epochs/``) and asks every
master in etcd for its ``/admission`` snapshot (at ``admin`` in its key when it serves that on a
separate listener, else at ``http``). Masters hold the shares and epochs the agents granted them;
the nodes' keys hold their capacity. From that it prints the masters, the nodes with each master's
share and epoch in one row, and what is inconsistent: a node whose shares add up to more (or, with
every master answering, less) than its capacity, a master that a node has no stream to, a master
behind on a node's epoch, a master whose endpoint does not answer, an engine reported down.

Shares move for a moment on every join, failover and demand rebalance, so a problem counts only
when a second look ``--settle`` seconds later still shows it (``--watch``: when the previous redraw
showed it too). Exit status: 0 all consistent, 1 a problem, 2 etcd unreadable or bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdcoord.config import (
    EnvArgumentParser,
    EtcdSettings,
    add_etcd_flags,
    positive_float,
    setup_logging,
)
from pdcoord.etcd import EtcdClient, EtcdError
from pdcoord.keys import Keys
from pdcoord.tls import TLSConfigError

__all__ = ["Fleet", "Problem", "build_parser", "check", "collect", "main", "render", "report"]

EXIT_OK, EXIT_PROBLEMS, EXIT_ERROR = 0, 1, 2
WILDCARDS = ("0.0.0.0", "::", "[::]")
CLASS_ABBREV = {"continuation": "cont", "probable_cache_hit": "prob", "cold": "cold"}


@dataclass(frozen=True)
class Problem:
    kind: str  # unreachable, no_stream, stale_epoch, over_capacity, unheld, engine_down, ...
    subject: str  # "master m2", "node d1", "node d1 / master m2"
    message: str

    @property
    def key(self) -> tuple[str, str]:
        """Identity across looks (the message carries numbers that may move)."""
        return (self.kind, self.subject)

    def as_json(self) -> dict[str, str]:
        return {"kind": self.kind, "subject": self.subject, "message": self.message}


@dataclass
class Fleet:
    """One look at a cluster: its keys in etcd and what each master's ``/admission`` said."""

    cluster: str
    masters: dict[str, dict[str, Any]] = field(default_factory=dict)  # master id -> key document
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)  # node id -> key document
    epochs: dict[str, int] = field(default_factory=dict)  # node id -> epoch persisted in etcd
    admission: dict[str, dict[str, Any]] = field(default_factory=dict)  # master id -> /admission
    errors: dict[str, str] = field(default_factory=dict)  # master id -> why /admission is missing
    taken_at: float = 0.0

    def endpoint(self, master_id: str) -> str:
        doc = self.masters[master_id]
        return str(doc.get("admin") or doc.get("http") or "")

    def entry(self, master_id: str, node_id: str) -> dict[str, Any] | None:
        """What *master_id* holds of *node_id* (its registry's row), None when it does not know it."""
        for n in self.admission.get(master_id, {}).get("nodes", []):
            if n.get("node_id") == node_id:
                return dict(n)
        return None

    def node_ids(self) -> list[str]:
        """Nodes in etcd, then those only a master knows over a live stream."""
        ids = set(self.nodes)
        for adm in self.admission.values():
            ids.update(n["node_id"] for n in adm.get("nodes", []) if n.get("connected"))
        return sorted(ids)


# -- collecting ----------------------------------------------------------------------------------------
def _json_doc(value: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(value)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"unreadable": value[:200].decode("utf-8", "replace")}
    return doc if isinstance(doc, dict) else {"unreadable": repr(doc)[:200]}


async def _admission(http: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> dict[str, Any]:
    async with http.get(url.rstrip("/") + "/admission", headers=headers) as resp:
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status} {resp.reason or ''}".strip())
        body = await resp.json(content_type=None)
    if not isinstance(body, dict):
        raise ValueError("/admission did not answer a JSON object")
    return body


async def collect(
    etcd: EtcdClient, keys: Keys, http: aiohttp.ClientSession, api_key: str | None = None
) -> Fleet:
    """One look: one range read of the cluster's keys, then every master's ``/admission`` at once.

    EtcdError when etcd cannot be read; a master that does not answer is recorded in ``errors``.
    """
    fleet = Fleet(cluster=keys.cluster, taken_at=time.time())
    kvs, _ = await etcd.get_prefix(keys.root)
    for kv in kvs:
        for prefix, into in ((keys.masters_prefix, fleet.masters), (keys.nodes_prefix, fleet.nodes)):
            if kv.key.startswith(prefix):
                try:
                    into[Keys.id_from_key(kv.key, prefix)] = _json_doc(kv.value)
                except ValueError:
                    pass  # not a member's key (written by hand under the root)
        if kv.key.startswith(keys.epochs_prefix):
            try:
                fleet.epochs[Keys.id_from_key(kv.key, keys.epochs_prefix)] = int(kv.value)
            except ValueError:
                pass
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def ask(master_id: str) -> None:
        url = fleet.endpoint(master_id)
        if not url:
            fleet.errors[master_id] = "its etcd key names no http or admin address"
            return
        try:
            fleet.admission[master_id] = await _admission(http, url, headers)
        except aiohttp.ClientConnectorError as exc:
            err = exc.os_error
            fleet.errors[master_id] = f"cannot connect: {os.strerror(err.errno) if err.errno else err}"
        except TimeoutError:
            fleet.errors[master_id] = "timed out"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            fleet.errors[master_id] = str(exc) or type(exc).__name__

    await asyncio.gather(*(ask(m) for m in sorted(fleet.masters)))
    return fleet


# -- checking ------------------------------------------------------------------------------------------
def latest_epoch(fleet: Fleet, node_id: str) -> int:
    """The newest epoch of *node_id* anyone has seen: what masters hold, and what etcd persisted (which
    lags the agent by about a second, so a master below it is behind for at least that long)."""
    seen = [fleet.epochs.get(node_id, 0), int(fleet.nodes.get(node_id, {}).get("last_epoch") or 0)]
    for m in fleet.admission:
        e = fleet.entry(m, node_id)
        if e is not None and e.get("connected"):
            seen.append(int(e.get("epoch") or 0))
    return max(seen)


def _held(fleet: Fleet, node_id: str) -> dict[str, int]:
    """master id -> slots granted on *node_id*, for the masters that answered and hold a stream there."""
    out: dict[str, int] = {}
    for m in sorted(fleet.admission):
        e = fleet.entry(m, node_id)
        if e is not None and e.get("connected"):
            out[m] = int(e.get("share") or 0)
    return out


def _held_tokens(fleet: Fleet, node_id: str) -> dict[str, int]:
    """master id -> KV tokens granted on *node_id* (masters that answered, hold a stream there and say
    a token share: a master of an earlier release says none)."""
    out: dict[str, int] = {}
    for m in sorted(fleet.admission):
        e = fleet.entry(m, node_id)
        if e is not None and e.get("connected") and isinstance(e.get("token_share"), int):
            out[m] = int(e["token_share"])
    return out


def check(fleet: Fleet) -> list[Problem]:
    """What is inconsistent in one look, in a stable order."""
    out: list[Problem] = []
    if not fleet.masters:
        out.append(
            Problem("no_masters", "cluster", f"no master is registered in etcd (cluster {fleet.cluster})")
        )
    if not fleet.nodes:
        out.append(
            Problem("no_nodes", "cluster", f"no node agent is registered in etcd (cluster {fleet.cluster})")
        )
    for m in sorted(fleet.masters):
        doc = fleet.masters[m]
        if m in fleet.errors:
            out.append(
                Problem(
                    "unreachable",
                    f"master {m}",
                    f"master {m} is registered in etcd but {fleet.endpoint(m) or 'its endpoint'} does not "
                    f"answer /admission ({fleet.errors[m]})",
                )
            )
        grpc = str(doc.get("grpc", ""))
        if grpc.rpartition(":")[0] in WILDCARDS:
            out.append(
                Problem(
                    "wildcard",
                    f"master {m}",
                    f"master {m} advertises {grpc}: agents on other hosts cannot reach it "
                    "(restart it with --advertise-host)",
                )
            )
    answered = sorted(fleet.admission)
    everyone_answered = bool(fleet.masters) and not fleet.errors
    for n in fleet.node_ids():
        node = fleet.nodes.get(n)
        if node is None:
            holders = [m for m in answered if (e := fleet.entry(m, n)) is not None and e.get("connected")]
            out.append(
                Problem(
                    "unknown_node",
                    f"node {n}",
                    f"node {n} streams to {', '.join(holders)} but has no key in etcd "
                    "(its agent lost its lease?)",
                )
            )
            continue
        capacity = int(node.get("running_max_req_size") or 0)
        newest = latest_epoch(fleet, n)
        for m in answered:
            if m not in fleet.masters or fleet.admission[m].get("draining"):
                continue  # a draining master hands its shares back: no stream there is expected
            e = fleet.entry(m, n)
            if e is None or not e.get("connected"):
                out.append(
                    Problem("no_stream", f"node {n} / master {m}", f"node {n} has no stream to master {m}")
                )
                continue
            if not e.get("legacy") and int(e.get("epoch") or 0) < newest:
                out.append(
                    Problem(
                        "stale_epoch",
                        f"node {n} / master {m}",
                        f"master {m} holds epoch {e.get('epoch')} of node {n}, which has issued {newest}",
                    )
                )
            if e.get("engine_down"):
                out.append(
                    Problem(
                        "engine_down",
                        f"node {n}",
                        f"node {n}: its agent reports the engine down "
                        f"({e.get('engine_reason') or 'no reason'})",
                    )
                )
        held = _held(fleet, n)
        total = sum(held.values())
        parts = ", ".join(f"{m} {s}" for m, s in held.items()) or "none"
        if total > capacity:
            legacy = any((fleet.entry(m, n) or {}).get("legacy") for m in held)
            out.append(
                Problem(
                    "over_capacity",
                    f"node {n}",
                    f"node {n}: masters hold {total} slots, above its capacity {capacity} ({parts})"
                    + ("; an agent that sends no grants gives every master all of it" if legacy else ""),
                )
            )
        elif total < capacity and everyone_answered:
            out.append(
                Problem(
                    "unheld",
                    f"node {n}",
                    f"node {n}: masters hold {total} of its {capacity} slots ({parts}); the rest waits "
                    "for a handover (a departed master's requests to end)",
                )
            )
        pool = node.get("kv_tokens")
        tokens = _held_tokens(fleet, n)
        held_t = sum(tokens.values())
        if isinstance(pool, int) and pool > 0 and held_t > pool:
            listed = ", ".join(f"{m} {t}" for m, t in tokens.items())
            out.append(
                Problem(
                    "over_pool",
                    f"node {n}",
                    f"node {n}: masters hold {held_t} KV tokens, above its pool {pool} ({listed})",
                )
            )
    # one engine_down per node, whichever master said it first
    seen: set[tuple[str, str]] = set()
    unique = []
    for p in out:
        if p.key not in seen:
            seen.add(p.key)
            unique.append(p)
    return unique


def confirm(previous: list[Problem] | None, current: list[Problem]) -> tuple[list[Problem], list[Problem]]:
    """(problems, settling): those of *current* the previous look showed too, and those it did not.
    Without a previous look everything counts."""
    if previous is None:
        return current, []
    before = {p.key for p in previous}
    return [p for p in current if p.key in before], [p for p in current if p.key not in before]


# -- reporting -----------------------------------------------------------------------------------------
def _master_row(fleet: Fleet, m: str) -> dict[str, Any]:
    doc = fleet.masters[m]
    row: dict[str, Any] = {
        "master_id": m,
        "endpoint": fleet.endpoint(m),
        "grpc": doc.get("grpc"),
        "version": doc.get("version"),
        "started_at": doc.get("started_at"),
        "answered": m in fleet.admission,
    }
    adm = fleet.admission.get(m)
    if adm is None:
        row["error"] = fleet.errors.get(m, "")
        return row
    classes = adm.get("classes") or {}
    row.update(
        draining=bool(adm.get("draining")),
        capacity=adm.get("capacity"),
        active=adm.get("active"),
        queued_requests=adm.get("queued_requests"),
        queued_slots=adm.get("queued_slots"),
        queue_bound_slots=adm.get("queue_bound_slots"),
        classes={k: (v or {}).get("queued_requests", 0) for k, v in classes.items()},
        bypass=bool(adm.get("bypass")),
    )
    return row


def _node_row(fleet: Fleet, n: str) -> dict[str, Any]:
    doc = fleet.nodes.get(n, {})
    newest = latest_epoch(fleet, n)
    shares: dict[str, Any] = {}
    engine_down: list[str] = []
    breakers: dict[str, str] = {}
    load: dict[str, Any] | None = None
    role = doc.get("role")
    for m in sorted(fleet.masters):
        if m not in fleet.admission:
            shares[m] = None  # unknown: the master did not answer
            continue
        e = fleet.entry(m, n)
        if e is None:
            shares[m] = {"connected": False}
            continue
        role = role or e.get("role")
        epoch = int(e.get("epoch") or 0)
        shares[m] = {
            "share": int(e.get("share") or 0),
            "effective_share": int(e.get("effective_share") or 0),
            "epoch": epoch,
            "connected": bool(e.get("connected")),
            "stale": bool(e.get("connected")) and not e.get("legacy") and epoch < newest,
            # its slice of the node's KV pool (None: no pool, or a master that takes no token share)
            "token_share": e.get("token_share") if isinstance(e.get("token_share"), int) else None,
        }
        if e.get("engine_down"):
            engine_down.append(str(e.get("engine_reason") or ""))
        if e.get("breaker_state", "closed") != "closed":
            breakers[m] = f"{e.get('breaker_state')}: {e.get('breaker_reason') or ''}".rstrip(": ")
        if e.get("connected") and isinstance(e.get("load"), dict):
            load = e["load"]
    held = _held(fleet, n)
    if fleet.admission:
        engine: dict[str, Any] = {"up": not engine_down, "reason": next((r for r in engine_down if r), "")}
    else:
        engine = {"up": None, "reason": "no master answered"}
    if breakers:
        engine["breakers"] = breakers
    return {
        "node_id": n,
        "role": role,
        "endpoint": doc.get("endpoint"),
        "capacity": doc.get("running_max_req_size"),
        # the KV pool in tokens; None: the engine publishes none (slots only) or the agent is older
        "kv_tokens": doc.get("kv_tokens"),
        "capacity_unit": _capacity_unit(doc),
        "agent_version": doc.get("agent_version"),
        "in_etcd": n in fleet.nodes,
        "held": sum(held.values()),
        "epoch": newest,
        "engine": engine,
        "load": load,
        "shares": shares,
    }


def _capacity_unit(doc: dict[str, Any]) -> str | None:
    """What the node's capacity is counted in, by its key: an agent of this release writes
    ``kv_tokens`` (null when its engine publishes no pool); an older agent's key has no such field."""
    if "kv_tokens" not in doc:
        return None
    return "slots and kv tokens" if doc.get("kv_tokens") else "slots only"


def report(fleet: Fleet, problems: list[Problem], settling: list[Problem] | None = None) -> dict[str, Any]:
    """The look as one JSON-able document (what ``--json`` prints)."""
    nodes = [_node_row(fleet, n) for n in fleet.node_ids()]
    decode = [r for r in nodes if r["role"] == "decode" and r["in_etcd"]]
    return {
        "cluster": fleet.cluster,
        "taken_at": fleet.taken_at,
        "ok": not problems,
        "decode_capacity": sum(int(r["capacity"] or 0) for r in decode),
        "decode_held": sum(r["held"] for r in decode),
        "masters": [_master_row(fleet, m) for m in sorted(fleet.masters)],
        "nodes": nodes,
        "problems": [p.as_json() for p in problems],
        "settling": [p.as_json() for p in settling or []],
    }


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    """Columns padded to width: those in *right* (numbers) right-aligned, the others left-aligned."""
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        out = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _share_cell(share: dict[str, Any] | None) -> str:
    if share is None:
        return "?"
    if not share.get("connected"):
        return "no stream"
    cell = str(share["share"])
    if share["effective_share"] != share["share"]:
        cell += f" ({share['effective_share']} usable)"
    if share.get("token_share") is not None:
        cell += f" · {share['token_share']} tok"
    if share["stale"]:
        cell += f" stale@{share['epoch']}"
    return cell


def _engine_cell(engine: dict[str, Any]) -> str:
    if engine["up"] is None:
        cell = "?"
    else:
        cell = "up" if engine["up"] else "down" + (f": {engine['reason']}" if engine["reason"] else "")
    for m, state in (engine.get("breakers") or {}).items():
        cell += f"; {m} breaker {state}"
    return cell


def _kv_cell(row: dict[str, Any]) -> str:
    """The node's KV pool, or "slots only" when its engine publishes none ("-": an older agent)."""
    if row.get("kv_tokens"):
        return str(row["kv_tokens"])
    return "slots only" if row.get("capacity_unit") == "slots only" else "-"


def _load_cell(load: dict[str, Any] | None) -> str:
    if not load:
        return "-"
    if not load.get("probe_ok", True):
        return "no probe"
    kv = float(load.get("kv_usage") or 0.0)
    return f"{load.get('running', 0)}/{load.get('waiting', 0)}/{kv:.0%}"


def render(doc: dict[str, Any], etcd: str = "") -> str:
    """The look as text: a header line, the masters, the nodes, the problems."""
    masters, nodes = doc["masters"], doc["nodes"]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(doc["taken_at"]))
    head = (
        f"cluster {doc['cluster']}" + (f" · etcd {etcd}" if etcd else "")
        + f" · {_count(len(masters), 'master')} · {_count(len(nodes), 'node')}"
        + f" · decode capacity {doc['decode_capacity']}, held {doc['decode_held']} · {when}"
    )  # fmt: skip
    classes: list[str] = []
    for m in masters:
        for k in m.get("classes") or {}:
            if k not in classes:
                classes.append(k)
    class_head = "queued " + "/".join(CLASS_ABBREV.get(k, k[:4]) for k in classes) if classes else "by class"
    mrows = []
    for m in masters:
        if not m["answered"]:
            mrows.append([m["master_id"], m["endpoint"], _dash(m["grpc"]), "?", "?", "?", "?", "?",
                          _dash(m["version"]), "no answer"])  # fmt: skip
            continue
        per_class = "/".join(str(m["classes"].get(k, 0)) for k in classes) if classes else "-"
        note = "admission bypassed" if m.get("bypass") else ""
        mrows.append([m["master_id"], m["endpoint"], _dash(m["grpc"]), "yes" if m["draining"] else "no",
                      _dash(m["capacity"]), _dash(m["active"]), _dash(m["queued_requests"]), per_class,
                      _dash(m["version"]), note])  # fmt: skip
    mhead = [
        "master",
        "endpoint",
        "grpc",
        "draining",
        "capacity",
        "active",
        "queued",
        class_head,
        "version",
        "",
    ]
    ids = [m["master_id"] for m in masters]
    nrows = []
    for n in nodes:
        nrows.append([n["node_id"], _dash(n["role"]), _dash(n["capacity"]), _kv_cell(n),
                      str(n["held"]), _engine_cell(n["engine"]), _load_cell(n["load"]),
                      str(n["epoch"] or "-"), *(_share_cell(n["shares"].get(m)) for m in ids)])  # fmt: skip
    nhead = ["node", "role", "capacity", "kv tokens", "held", "engine", "load r/w/kv", "epoch", *ids]
    parts = [head, "", "masters", _table(mhead, mrows, {4, 5, 6, 7}) if mrows else "  (none registered)"]
    parts += [
        "",
        "nodes (one column per master: its share)",
        _table(nhead, nrows, {2, 3, 4, 7, *range(8, 8 + len(ids))}) if nrows else "  (none)",
    ]
    for title, items in (
        ("problems", doc["problems"]),
        ("settling (seen once; checked again)", doc["settling"]),
    ):
        if items:
            parts += ["", f"{title}:"] + [f"  {p['message']}" for p in items]
    n = len(doc["problems"])
    if n:
        parts += ["", f"status: {_count(n, 'problem')}"]
    elif doc["settling"]:
        parts += ["", f"status: no confirmed problem ({len(doc['settling'])} seen once, checked again)"]
    else:
        parts += ["", "status: ok"]
    return "\n".join(parts)


# -- the command -------------------------------------------------------------------------------------
def build_parser(prog: str = "pdcoord status") -> EnvArgumentParser:
    p = EnvArgumentParser(
        prog=prog,
        description="Show the fleet of one pdcoord cluster: masters, nodes, every master's share and "
        "epoch on every node, and what is inconsistent. Exit status 0 when all is consistent, 1 when "
        "something is wrong, 2 when etcd cannot be read or a flag is wrong.",
        env_prefix="PDCOORD",
    )
    add_etcd_flags(p)
    for action in p._actions:  # the lease TTL is the binaries'; a reader takes no lease
        if "--lease-ttl" in action.option_strings:
            action.help = argparse.SUPPRESS
    g = p.add_argument_group("output")
    g.add_argument(
        "--json", action="store_true", help="print the look as JSON (one object per line with --watch)"
    )
    g.add_argument(
        "--watch",
        type=positive_float,
        nargs="?",
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (2 when omitted) until interrupted",
    )
    g.add_argument(
        "--settle",
        type=float,
        default=1.5,
        help="seconds before a second look that a problem must survive to count (shares move for a moment "
        "on every join, failover and rebalance); 0: one look",
    )
    g.add_argument(
        "--timeout", type=positive_float, default=2.0, help="seconds to wait for etcd and each master"
    )
    g.add_argument(
        "--api-key",
        default=None,
        secret=True,
        help="API key for masters that serve /admission on their API port behind --api-key",
    )
    return p


class _Looker:
    def __init__(self, args: argparse.Namespace, settings: EtcdSettings) -> None:
        self.args = args
        self.settings = settings
        self.keys = Keys.for_cluster(settings.cluster, settings.prefix)

    async def look(self, etcd: EtcdClient, http: aiohttp.ClientSession) -> Fleet:
        async with asyncio.timeout(self.args.timeout * 3):
            return await collect(etcd, self.keys, http, self.args.api_key)

    def emit(self, fleet: Fleet, problems: list[Problem], settling: list[Problem]) -> None:
        doc = report(fleet, problems, settling)
        if self.args.json:
            print(json.dumps(doc, indent=None if self.args.watch else 2, sort_keys=False), flush=True)
        else:
            print(render(doc, ",".join(self.settings.endpoints)), flush=True)

    async def run(self) -> int:
        args = self.args
        etcd = EtcdClient(self.settings.endpoints, timeout=args.timeout, **self.settings.options)
        timeout = aiohttp.ClientTimeout(total=args.timeout)
        try:
            await etcd.connect()
            async with aiohttp.ClientSession(timeout=timeout) as http:
                if args.watch is None:
                    return await self.once(etcd, http)
                return await self.watch(etcd, http)
        finally:
            await etcd.close()

    async def once(self, etcd: EtcdClient, http: aiohttp.ClientSession) -> int:
        fleet = await self.look(etcd, http)
        problems, settling = check(fleet), list[Problem]()
        if problems and self.args.settle > 0:
            await asyncio.sleep(self.args.settle)
            first = problems
            fleet = await self.look(etcd, http)
            problems, settling = confirm(first, check(fleet))
        self.emit(fleet, problems, settling)
        return EXIT_PROBLEMS if problems else EXIT_OK

    async def watch(self, etcd: EtcdClient, http: aiohttp.ClientSession) -> int:
        previous: list[Problem] | None = None
        clear = sys.stdout.isatty() and not self.args.json
        while True:
            try:
                fleet = await self.look(etcd, http)
            except (EtcdError, TimeoutError) as exc:
                print(f"pdcoord status: etcd: {exc}", file=sys.stderr, flush=True)
                previous = None
            else:
                current = check(fleet)
                # the first redraw has nothing to confirm against: its problems wait for the next one
                problems, settling = confirm(previous or [], current)
                previous = current
                if clear:
                    print("\x1b[H\x1b[2J", end="")
                self.emit(fleet, problems, settling)
                if not clear and not self.args.json:
                    print()
            await asyncio.sleep(self.args.watch)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    setup_logging("error", "pdcoord-status")
    try:
        settings = EtcdSettings.from_args(args)
        looker = _Looker(args, settings)
    except (TLSConfigError, ValueError) as exc:
        print(f"pdcoord status: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        return asyncio.run(looker.run())
    except (EtcdError, TimeoutError) as exc:
        where = ",".join(settings.endpoints)
        print(f"pdcoord status: error: cannot read etcd at {where}: {exc or 'timed out'}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
