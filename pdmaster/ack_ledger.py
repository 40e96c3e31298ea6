"""Strict-handover bookkeeping for the Acks a master sends each decode node's agent (DESIGN §4-§5).

An agent hands a master's share on to another master only once the slots it held there are free. A
master's Ack says how many of its slots it *kept* since its previous Ack: leases whose decode request
had gone out (the engine surely holds them, :meth:`AckLedger.decode_sent`), that still run and whose
end the master sees (not :meth:`AckLedger.end_unseen`). This ledger counts them per node, exactly
whatever turned over between two Acks, in O(1) per lease event and per Ack. The same holds for the
KV tokens those leases charge (DESIGN §13): every count has its token twin, and an Ack's kept tokens
are those of exactly the leases its kept slots count.
"""

from __future__ import annotations

from pdmaster.ticket import Ticket

__all__ = ["AckLedger"]


class AckLedger:
    """Per node: slots ever granted, in decode, unseen, and the Acks built so far."""

    __slots__ = (
        "ack_gen",
        "granted_on",
        "in_decode",
        "in_decode_tokens",
        "kept_tokens",
        "old",
        "old_tokens",
        "unseen_on",
    )

    def __init__(self) -> None:
        # Slots ever granted per node (only grows): what masters of the previous release counted an
        # Ack's kept_slots from (registry.kept_slots; the protocol model's earlier-release masters).
        self.granted_on: dict[str, int] = {}
        # Slots of running leases whose decode end this master may not see in time (end_unseen):
        # not counted in an Ack's kept_slots.
        self.unseen_on: dict[str, int] = {}
        # Slots whose decode request went out and that are still held and seen, per node: an Ack's
        # kept_slots counts from these (``in_decode``).
        self.in_decode: dict[str, int] = {}
        # Per node: Acks built so far (kept_since), and the slots in decode at the last of them that
        # still are: an Ack's kept_slots, exact whatever turned over in between.
        self.ack_gen: dict[str, int] = {}
        self.old: dict[str, int] = {}
        # The token twins of in_decode and old.
        self.in_decode_tokens: dict[str, int] = {}
        self.old_tokens: dict[str, int] = {}
        self.kept_tokens: dict[str, int] = {}  # the kept tokens of the node's latest Ack

    def granted(self, node: str, slots: int) -> None:
        self.granted_on[node] = self.granted_on.get(node, 0) + slots

    def decode_sent(self, t: Ticket, node: str) -> None:
        """The granted, unreleased, unsent lease ``t`` on ``node`` went out to its engine."""
        t.sent = True
        t.sent_gen = self.ack_gen.get(node, 0)
        if not t.unseen:
            self.in_decode[node] = self.in_decode.get(node, 0) + t.slots
            if t.tokens:
                self.in_decode_tokens[node] = self.in_decode_tokens.get(node, 0) + t.tokens

    def kept_since(self, node: str, gen: int | None) -> tuple[int, int, int]:
        """For an Ack on ``node``: the slots and the tokens in decode there at the previous Ack (number
        ``gen``) that still are, and this Ack's number. 0 when ``gen`` is None (a stream's first Ack)
        or is not the latest (another stream's Ack came in between)."""
        latest = self.ack_gen.get(node, 0)
        if gen is not None and gen == latest:
            kept, kept_tokens = self.old.get(node, 0), self.old_tokens.get(node, 0)
        else:
            kept = kept_tokens = 0
        self.ack_gen[node] = latest + 1
        self.old[node] = self.in_decode.get(node, 0)
        self.old_tokens[node] = self.in_decode_tokens.get(node, 0)
        self.kept_tokens[node] = kept_tokens
        return kept, kept_tokens, latest + 1

    def _leave_decode(self, t: Ticket, node: str) -> None:
        """A sent lease stops counting as in decode (released, or its end unseen)."""
        self.in_decode[node] -= t.slots
        if t.tokens:
            self.in_decode_tokens[node] -= t.tokens
        if t.sent_gen < self.ack_gen.get(node, 0):
            self.old[node] -= t.slots  # it was in decode at the last Ack
            if t.tokens:
                self.old_tokens[node] -= t.tokens

    def end_unseen(self, t: Ticket, node: str) -> None:
        """The granted, unreleased lease ``t`` on ``node`` is no longer surely seen to end."""
        t.unseen = True
        self.unseen_on[node] = self.unseen_on.get(node, 0) + t.slots
        if t.sent:
            self._leave_decode(t, node)

    def released(self, t: Ticket, node: str) -> None:
        """The lease ``t`` on ``node`` ended."""
        if t.unseen:
            self.unseen_on[node] -= t.slots
        elif t.sent:
            self._leave_decode(t, node)

    def unseen_total(self) -> int:
        return sum(self.unseen_on.values())

    def forget(self, node: str) -> None:
        """Drop everything kept for ``node``."""
        for per_node in (
            self.granted_on,
            self.unseen_on,
            self.in_decode,
            self.ack_gen,
            self.old,
            self.in_decode_tokens,
            self.old_tokens,
            self.kept_tokens,
        ):
            per_node.pop(node, None)
