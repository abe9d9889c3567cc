"""Which cached prompt tokens an inference server may reuse for a request, one class per server kind.

A customer's text is reused only by the session that wrote it: another session that could hit it would
read it back from `cached_tokens` or from its first token's time (docs/security.md). What is shared
across sessions differs by kind:
- rtserver nodes take `rtserver_public_tokens` and share only that prefix; they keep a session's KV
  under its key until the hub says the session ended (`forgotten`, sent by the backend);
- vLLM takes a `cache_salt` and shares a prompt's blocks only with requests of the same salt;
- llama-server has no such field: it picks a slot by prompt similarity and may restore a prompt saved
  from any slot (`--cache-ram`). `SlotLedger` pins each session to a slot of its own (`id_slot`) and
  sends `cache_prompt` only while that slot holds the session's own tokens, or public ones only: after
  a scoring call its slot is cut back to the public prefix, which any later request may reuse;
- other OpenAI-compatible servers can be isolated by nothing we send: `cached_tokens` is clamped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from collections.abc import Hashable
from typing import Protocol, TypedDict

from .pool import BackendUnavailable, Wakeup

log = logging.getLogger("rtserver.remote")


class LeaseFields(TypedDict, total=False):
    """What a request's body says of the server's prompt cache."""

    cache_prompt: bool  # llama-server and rtserver: reuse the cached prefix
    id_slot: int  # llama-server: the slot to run in
    cache_salt: str  # vLLM: share blocks only with requests of the same salt
    rtserver_public_tokens: int  # rtserver: the prefix any session may share
    rtserver_session: str  # rtserver: the session whose KV it keeps


class Lease(Protocol):
    """The reuse rules of one request (or of one scoring call's requests, in turn)."""

    def fields(self, prompt: list[int]) -> LeaseFields:
        """Body fields for a request with this prompt."""
        ...

    def cached(self, reported: int) -> int:
        """The cached-token count the caller may see."""
        ...

    def wrote(self, prompt: list[int], generated: list[int]) -> None:
        """A request was answered: the server now holds `prompt` + `generated` for it."""
        ...

    def release(self) -> None:
        """The last request ended (answered or not)."""
        ...

    def public_fields(self) -> LeaseFields | None:
        """Body fields for a request that leaves the server holding only the public prefix, or None
        where nothing needs it."""
        ...

    def wrote_public(self, prefix: list[int]) -> None:
        """That request was answered: the server holds `prefix` and one token computed from it."""
        ...


class Reuse(Protocol):
    """Leases for one server."""

    async def lease(self, session_key: Hashable | None, public_tokens: int, timeout_s: float) -> Lease:
        """The rules for a request; it may wait (bounded) for room on the server."""
        ...

    def own_lease(self, session_key: Hashable) -> Lease | None:
        """A lease that reuses only the session's own cache, or None when there is none to reuse."""
        ...

    def forget(self, session_key: Hashable) -> None:
        """The session has ended: its cache need not be kept for it."""
        ...


class _Plain:
    """A lease whose body fields are fixed."""

    def __init__(self, fields: LeaseFields, cached_cap: int | None = None):
        self._fields = fields
        self._cap = cached_cap

    def fields(self, prompt: list[int]) -> LeaseFields:
        return self._fields

    def cached(self, reported: int) -> int:
        return reported if self._cap is None else min(reported, self._cap)

    def wrote(self, prompt: list[int], generated: list[int]) -> None:
        pass

    def release(self) -> None:
        pass

    def public_fields(self) -> LeaseFields | None:
        return None

    def wrote_public(self, prefix: list[int]) -> None:
        pass


MAX_FORGOTTEN = 4096  # ended sessions waiting to be sent; beyond, the oldest are left to the node's LRU


class NodeReuse:
    """An rtserver node: it shares the public prefix and keeps a session's KV under its id until told
    the session ended."""

    def __init__(self) -> None:
        self.forgotten: dict[str, None] = {}  # keys of ended sessions the node still keeps, in order

    def take_forgotten(self, most: int) -> list[str]:
        """Up to `most` ended sessions' keys, oldest first, to tell the node."""
        keys = list(self.forgotten)[:most]
        for key in keys:
            del self.forgotten[key]
        return keys

    async def lease(self, session_key: Hashable | None, public_tokens: int, timeout_s: float) -> Lease:
        fields: LeaseFields = {"cache_prompt": True, "rtserver_public_tokens": public_tokens}
        if session_key is not None:
            fields["rtserver_session"] = str(session_key)
        return _Plain(fields)

    def own_lease(self, session_key: Hashable) -> Lease | None:
        return _Plain({"rtserver_session": str(session_key), "rtserver_public_tokens": 0})

    def forget(self, session_key: Hashable) -> None:
        self.forgotten[str(session_key)] = None
        while len(self.forgotten) > MAX_FORGOTTEN:
            del self.forgotten[next(iter(self.forgotten))]


class SaltedReuse:
    """vLLM: a salt per session; a request with private tokens and no session gets a salt of its own."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(16)  # salts name no session to the server

    def _salt(self, session_key: Hashable) -> str:
        return hashlib.blake2b(repr(session_key).encode(), key=self._secret, digest_size=16).hexdigest()

    async def lease(self, session_key: Hashable | None, public_tokens: int, timeout_s: float) -> Lease:
        if session_key is None:
            return _SaltIfPrivate(public_tokens, secrets.token_hex(16))
        return _SaltIfPrivate(public_tokens, self._salt(session_key))

    def own_lease(self, session_key: Hashable) -> Lease | None:
        return _Plain({"cache_salt": self._salt(session_key)})

    def forget(self, session_key: Hashable) -> None:
        pass


class _SaltIfPrivate(_Plain):
    """No salt for a prompt that is public to its end: every request may share it."""

    def __init__(self, public_tokens: int, salt: str):
        super().__init__({})
        self._public = public_tokens
        self._salt = salt

    def fields(self, prompt: list[int]) -> LeaseFields:
        return {} if self._public >= len(prompt) else {"cache_salt": self._salt}


class BlindReuse:
    """A server we cannot tell what to share: the caller sees no more than the public prefix cached."""

    async def lease(self, session_key: Hashable | None, public_tokens: int, timeout_s: float) -> Lease:
        return _Plain({"cache_prompt": True}, cached_cap=public_tokens)

    def own_lease(self, session_key: Hashable) -> Lease | None:
        return None

    def forget(self, session_key: Hashable) -> None:
        pass


class _Slot:
    """What the ledger knows of one llama-server slot."""

    def __init__(self, index: int):
        self.index = index
        self.owner: Hashable | None = None  # None: nobody's tokens may be reused from it
        self.public = False  # holds public tokens only: anyone may reuse them
        self.tokens: list[int] = []
        self.size = 0  # tokens the server holds in it (the generated ones may be spelled otherwise)
        self.busy = False
        self.last_used = 0


class SlotLedger:
    """llama-server: each session on a slot of its own, reused only while it holds that session's
    tokens. The hub must be the server's only client: it knows a slot's content from what it sent."""

    def __init__(self, total_slots: int):
        self.slots = [_Slot(i) for i in range(total_slots)]
        self._clock = 0
        self._freed = Wakeup()

    async def lease(self, session_key: Hashable | None, public_tokens: int, timeout_s: float) -> Lease:
        # a request waits here for a slot rather than in the server's queue: sent without one, it
        # could land on any slot, and no slot's content would be known after it
        owner: Hashable = session_key if session_key is not None else object()
        deadline = time.monotonic() + timeout_s
        while (slot := self._take(owner)) is None:
            if not await self._freed.next(deadline):
                raise BackendUnavailable(
                    f"all {len(self.slots)} llama-server slots stayed busy for {timeout_s} s"
                )
        return _SlotLease(self, slot, owner)

    def own_lease(self, session_key: Hashable) -> Lease | None:
        slot = next((s for s in self.slots if s.owner == session_key), None)
        if slot is None or slot.busy:
            return None
        slot.busy = True
        return _SlotLease(self, slot, session_key)

    def forget(self, session_key: Hashable) -> None:
        for slot in self.slots:
            if slot.owner is not None and slot.owner == session_key:
                slot.owner, slot.tokens = None, []  # a free slot for the next new session

    def _take(self, owner: Hashable) -> _Slot | None:
        free = [s for s in self.slots if not s.busy]
        if not free:
            return None
        own = [s for s in free if s.owner is not None and s.owner == owner]
        # then a public one, an empty one, the one used longest ago
        slot = own[0] if own else min(free, key=lambda s: (not s.public, s.owner is not None, s.last_used))
        slot.busy = True
        return slot

    def _release(self, slot: _Slot) -> None:
        self._clock += 1
        slot.busy = False
        slot.last_used = self._clock
        self._freed.wake()

    def reusable(self, slot: _Slot, owner: Hashable, prompt: list[int]) -> bool:
        """Whether `prompt` may reuse the slot: it holds only the owner's tokens or public ones (then a
        match says nothing of anyone), and the server keeps
        them rather than restoring another prompt from its host cache (its `get_available_slot`
        restores one when the slot would keep under half its tokens, or share a tenth of the prompt
        or less)."""
        mine = slot.owner is not None and slot.owner == owner
        if not (mine or slot.public) or not slot.size:
            return False
        common = len(os.path.commonprefix([slot.tokens, prompt]))
        return common >= 0.5 * slot.size and common > 0.1 * len(prompt)


class _SlotLease:
    def __init__(self, ledger: SlotLedger, slot: _Slot, owner: Hashable):
        self.ledger = ledger
        self.slot = slot
        self.owner = owner
        self.written = False
        self.closed = False

    def fields(self, prompt: list[int]) -> LeaseFields:
        reuse = self.ledger.reusable(self.slot, self.owner, prompt)
        return {"id_slot": self.slot.index, "cache_prompt": reuse}

    def cached(self, reported: int) -> int:
        return reported

    def wrote(self, prompt: list[int], generated: list[int]) -> None:
        self.written = True
        self.slot.owner, self.slot.tokens, self.slot.public = self.owner, prompt + generated, False
        self.slot.size = len(prompt) + len(generated)

    def public_fields(self) -> LeaseFields | None:
        if not self.written:
            return None
        self.written = False  # until that request is answered, the slot's content is not known
        return {"id_slot": self.slot.index, "cache_prompt": True}

    def wrote_public(self, prefix: list[int]) -> None:
        # the token sampled greedily after the prefix depends on the prefix alone: public too
        self.written = True
        self.slot.owner, self.slot.tokens, self.slot.public = None, list(prefix), True
        self.slot.size = len(prefix) + 1

    def release(self) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.written:  # failed on the way: the slot may hold part of anything
            self.slot.owner, self.slot.tokens, self.slot.public = None, [], False
        self.ledger._release(self.slot)


class Unlearned:
    """llama-server whose slot count is unknown (no /props): nothing private is reused."""

    async def lease(self, session_key: Hashable | None, public_tokens: int, timeout_s: float) -> Lease:
        return _Plain({"cache_prompt": False})

    def own_lease(self, session_key: Hashable) -> Lease | None:
        return None

    def forget(self, session_key: Hashable) -> None:
        pass


def reuse_for(kind: str, total_slots: int | None) -> Reuse:
    if kind == "rtserver":
        return NodeReuse()
    if kind == "vllm":
        return SaltedReuse()
    if kind == "llama.cpp":
        if not total_slots:
            log.warning("llama-server gave no slot count (/props): it reuses no session's prompt")
            return Unlearned()
        return SlotLedger(total_slots)
    return BlindReuse()
