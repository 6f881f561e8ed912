"""Which replicas take part in each step, decided on the job's store (a TCPStore).

Every rank of every member replica votes after its gradient all-reduce (ok, or failed: a peer was
lost inside it); the last ``ok`` voter decides that the step commits. A step commits only with
every member's every rank voting ok, so no rank applies a partial sum. When the supervisor evicts
a member (its heartbeats say a rank died or hangs), the waiting ranks decide an abort instead: the
step is redone by the next generation of members. Each decision is written once with
``compare_set``, so every rank reads the same outcome, and it carries the next generation (members
minus the evicted, plus a returning replica that has caught up), so membership only changes at a
step boundary that every rank agrees on. A commit also carries the newest plan change posted on the
store (``plan_key``), so every rank of every replica applies it at the same step boundary.

Every record of this protocol that says who is a member (evictions, join requests, held reports,
generations, admissions, decisions) is signed with the job's secret, and a plan change is taken
only with its signature (``resihp.detect.records``): a record without it is refused (one warning
per key) and acts as if absent; a refused decision ends the wait for it (``QuorumLost``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

from torch.distributed import DistStoreError, Store

from resihp.detect.records import (
    RECORDS,
    RecordError,
    authority,
    checked_int,
    job_secret,
    load_json,
    signed_json,
    verified,
)


@dataclass(frozen=True, order=True)
class Member:
    """One incarnation of a data-parallel replica: ``attempt`` counts its launches."""

    replica: int
    attempt: int = 0


@dataclass(frozen=True)
class Generation:
    """Members of the cross-replica groups from step ``from_step`` on (until the next one)."""

    gen: int
    members: tuple[Member, ...]
    from_step: int
    reason: str = ""

    @property
    def replicas(self) -> list[int]:
        return [m.replica for m in self.members]

    def to_dict(self) -> dict:
        return {
            "gen": self.gen,
            "members": [[m.replica, m.attempt] for m in self.members],
            "from_step": self.from_step,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: dict) -> Generation:
        return cls(
            int(data["gen"]),
            tuple(Member(int(r), int(a)) for r, a in data["members"]),
            int(data["from_step"]),
            str(data.get("reason", "")),
        )


@dataclass(frozen=True)
class Decision:
    step: int
    commit: bool
    next: (
        Generation  # the generation of the next attempt (step + 1 on commit, else this step again)
    )
    joined: tuple[Member, ...] = field(default=())  # returning replicas admitted by this decision
    plan: dict[str, Any] | None = None  # a commit: the newest plan change posted (its JSON form)
    seen: int = -1  # the store's change count the decider read first (see ``changes_key``)


def changes_key(job_id: str) -> str:
    """The store key of the job's change counter.

    It is bumped after every eviction, join request, held report and plan post: a commit whose
    decider reads the count the previous commit read follows it without looking further."""
    return f"resihp/{job_id}/ft/changes"


_REPLACE_TRIES = 100


def _ints(doc: Any) -> list[int]:
    if not isinstance(doc, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) for x in doc
    ):
        raise RecordError("expected a list of replica numbers")
    return doc


def _object(doc: Any) -> dict:
    if not isinstance(doc, dict):
        raise RecordError(f"expected a JSON object, got {type(doc).__name__}")
    return doc


class Evicted(RuntimeError):
    """This rank's replica is no longer a member (the supervisor evicted it)."""


class QuorumLost(RuntimeError):
    """A step could not be decided: a rank voted failed and no member was evicted in time."""


class Quorum:
    """The store protocol (``resihp/<job>/ft/...``).

    ``ranks_per_replica``: pipeline x tensor; ``plan_key``: where the live planner posts plan
    changes (None: the job takes none)."""

    def __init__(
        self,
        store: Store,
        job_id: str,
        ranks_per_replica: int,
        timeout_s: float = 60.0,
        plan_key: str | None = None,
        secret: str | None = None,
    ) -> None:
        self.store, self.prefix, self.changes = store, f"resihp/{job_id}/ft", changes_key(job_id)
        self.ranks_per_replica, self.timeout_s = ranks_per_replica, timeout_s
        self.plan_key = plan_key
        self._secret = secret  # None: this process's RESIHP_JOB_SECRET (``job_secret``)

    @property
    def secret(self) -> str:
        return self._secret or job_secret()

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    def _put(self, key: str, doc: dict) -> None:
        self.store.set(key, signed_json(doc, self.secret))

    def _get(self, key: str, what: str, spec: dict, same: dict) -> dict | None:
        """The signed record at ``key``, or None where nothing with the job's signature is there."""
        if not self.store.check([key]):
            return None
        return RECORDS.decode(
            key, self.store.get(key), authority(what, spec, secret=self.secret, same=same)
        )

    # --- the supervisor ---------------------------------------------------------------------------
    def start(self, members: list[Member], from_step: int) -> Generation:
        first = Generation(0, tuple(members), from_step, "start")
        self._publish(first)
        return first

    def evict(self, member: Member, reason: str) -> None:
        self._put(
            self._key("evicted", member.replica, member.attempt),
            {"replica": member.replica, "attempt": member.attempt, "reason": reason},
        )
        self.store.add(self.changes, 1)  # after the key: a decider that reads the count sees it

    def is_evicted(self, member: Member) -> bool:
        return (
            self._get(
                self._key("evicted", member.replica, member.attempt),
                "eviction",
                {"reason": str},
                {"replica": member.replica, "attempt": member.attempt},
            )
            is not None
        )

    def generation(self, gen: int) -> Generation:
        """Generation ``gen``; QuorumLost where the job's signed record of it is not there."""
        key = self._key("gen", gen)
        found = self._get(key, "generation", {"members": list, "from_step": int}, {"gen": gen})
        if found is None:
            raise QuorumLost(f"store key {key}: no generation {gen} signed with the job's secret")
        try:
            return Generation.from_dict(found)
        except (TypeError, ValueError) as exc:
            raise QuorumLost(
                f"store key {key}: field 'members' expected [replica, attempt] pairs ({exc})"
            ) from None

    def committed(self, step: int) -> list[int] | None:
        """The replicas whose ranks trained ``step`` (None: not committed yet)."""
        key = self._key("committed", step)
        return RECORDS.decode(key, self.store.get(key), _ints) if self.store.check([key]) else None

    def _publish(self, gen: Generation) -> None:
        self._put(self._key("gen", gen.gen), gen.to_dict())
        self.store.set(self._key("gen", "latest"), str(gen.gen))

    # --- returning replicas ---------------------------------------------------------------------
    def request_join(self, member: Member) -> None:
        self._put(
            self._key("join", member.replica),
            {"replica": member.replica, "attempt": member.attempt},
        )
        self.store.add(self.changes, 1)

    def join_request(self, replica: int) -> Member | None:
        said = self._get(
            self._key("join", replica), "join request", {"attempt": int}, {"replica": replica}
        )
        return None if said is None else Member(replica, int(said["attempt"]))

    def report_held(self, member: Member, local_rank: int, step: int) -> None:
        """A returning rank holds the survivors' state after ``step``.

        Args:
            member: the returning replica's member entry.
            local_rank: the rank's index in its replica.
            step: the step whose state it holds.
        """
        self._put(
            self._key("held", member.replica, member.attempt, local_rank),
            {
                "replica": member.replica,
                "attempt": member.attempt,
                "rank": local_rank,
                "step": step,
            },
        )
        self.store.add(self.changes, 1)

    def held(self, member: Member, ranks: list[int] | None = None) -> int | None:
        """The step every rank of a returning replica (or its ``ranks``) holds the state after.

        None: not all do."""
        ranks = range(self.ranks_per_replica) if ranks is None else ranks
        steps = [
            self._get(
                self._key("held", member.replica, member.attempt, r),
                "held report",
                {"step": int},
                {"replica": member.replica, "attempt": member.attempt, "rank": r},
            )
            for r in ranks
        ]
        if any(s is None for s in steps):
            return None
        return min(int(s["step"]) for s in steps)

    def report_relayout(self, plan_id: object, replica: int, record: dict) -> None:
        """Record what re-forming ``replica``'s groups for plan change ``plan_id`` moved.

        Only its first application counts: a returning replica that re-forms again as it rejoins
        does not.

        Args:
            plan_id: the plan change's id.
            replica: the replica that re-formed.
            record: its totals (bytes moved, written and read, seconds).
        """
        key = self._key("relayout", plan_id, replica)
        if not self.store.check([key]):
            self.store.set(key, json.dumps(record))

    def relayouts(self, plan_id: object, replicas: int) -> list[dict]:
        keys = [self._key("relayout", plan_id, d) for d in range(replicas)]
        found = (
            RECORDS.decode(k, self.store.get(k), _object) for k in keys if self.store.check([k])
        )
        return [r for r in found if r is not None]

    def set_heal_shape(self, member: Member, shape: list[int]) -> None:
        """The serving replica's groups, as tensor-parallel sizes per stage, for returning
        ``member``."""
        self._put(
            self._key("heal-shape", member.replica, member.attempt),
            {"replica": member.replica, "attempt": member.attempt, "shape": shape},
        )

    def heal_shape(self, member: Member) -> list[int] | None:
        said = self._get(
            self._key("heal-shape", member.replica, member.attempt),
            "heal shape",
            {"shape": list},
            {"replica": member.replica, "attempt": member.attempt},
        )
        return None if said is None else [int(n) for n in said["shape"]]

    def admitted(self, member: Member) -> Generation | None:
        """The generation that admitted a returning replica, once a decision did.

        Its ``from_step`` is the step the replica trains first."""
        said = self._get(
            self._key("admitted", member.replica, member.attempt),
            "admission",
            {"gen": int},
            {"replica": member.replica, "attempt": member.attempt},
        )
        return None if said is None else self.generation(int(said["gen"]))

    # --- the ranks ------------------------------------------------------------------------------
    def vote(
        self, gen: Generation, step: int, ok: bool, previous: Decision | None = None
    ) -> Decision | None:
        """This rank's vote; the last ok voter decides the commit (returned), others get None.

        Args:
            gen: the generation in force.
            step: the step voted on.
            ok: whether this rank's step succeeded (a failed vote decides nothing).
            previous: the decision this rank last followed (the commit of ``step - 1``, normally),
                which lets the decider of an unchanged job commit in four store round trips (its
                vote, the change count, the decision, the commit record) instead of about ten.
        """
        if not ok:
            self.store.add(self._key("vote", gen.gen, step, "fail"), 1)
            return None
        count = self.store.add(self._key("vote", gen.gen, step, "ok"), 1)
        if count == self.ranks_per_replica * len(gen.members):
            return self._decide(gen, step, commit=True, previous=previous)
        return None

    def wait(self, gen: Generation, step: int) -> Decision:
        """The decision of ``step`` under ``gen``, blocking on the store until it is written.

        It is written by the last ok voter (a commit) or by the supervisor (an abort, when it evicts
        a member)."""
        key = self._key("decision", gen.gen, step)
        end = time.monotonic() + self.timeout_s
        while True:
            try:
                self.store.wait([key], timedelta(seconds=max(0.001, end - time.monotonic())))
            except DistStoreError:
                raise QuorumLost(
                    f"step {step}: not decided within {self.timeout_s:g} s (a rank's gradient "
                    "all-reduce failed and no replica was evicted)"
                ) from None
            decision = self._read(key, step, gen.gen)
            if decision is not None:
                return decision
            if time.monotonic() > end:  # what is there is not the job's, and no decider replaced it
                raise QuorumLost(
                    f"store key {key}: step {step} not decided with the job's signature "
                    f"within {self.timeout_s:g} s"
                )
            time.sleep(0.01)

    def _decide(
        self, gen: Generation, step: int, commit: bool, previous: Decision | None = None
    ) -> Decision:
        seen = int(self.store.add(self.changes, 0))  # first: a change after it is seen next time
        if (
            commit
            and previous is not None
            and previous.commit
            and previous.seen == seen
            and previous.step == step - 1
            and previous.next == gen
        ):
            # nothing evicted, requested, held or posted since the last commit: it stands as it was
            return self._write(
                gen,
                step,
                Decision(step, True, replace(gen, from_step=step + 1), (), previous.plan, seen),
            )
        evicted = [m for m in gen.members if self.is_evicted(m)]
        members = [m for m in gen.members if m not in evicted]
        joined: list[Member] = []
        if commit:
            # a returning replica joins when every rank of it holds the state after step - 1: it
            # applies this step's gradients (sent after this decision) and trains step + 1
            present = {m.replica for m in members}
            for replica in sorted(
                {m.replica for m in gen.members} | set(self._requests()) - present
            ):
                m = self.join_request(replica)
                if m is not None and m.replica not in present and not self.is_evicted(m):
                    held = self.held(m)
                    if held is not None and held >= step - 1:
                        joined.append(m)
        members = sorted(members + joined)
        changed = tuple(members) != gen.members
        reason = ("rejoined " + ",".join(str(m.replica) for m in joined) if joined else "") + (
            ("; " if joined and evicted else "")
            + "evicted "
            + ",".join(str(m.replica) for m in evicted)
            if evicted
            else ""
        )
        nxt = Generation(
            gen.gen + 1 if changed else gen.gen,
            tuple(members),
            step + 1 if commit else step,
            reason if changed else gen.reason,
        )
        plan = self._plan(previous) if commit else None
        return self._write(gen, step, Decision(step, commit, nxt, tuple(joined), plan, seen))

    def _plan(self, previous: Decision | None) -> dict | None:
        """The newest plan change posted (as posted, its signature kept), where the job signed it;
        else the plan in force (a forged post leaves it as it was)."""
        if not self.plan_key or not self.store.check([self.plan_key]):
            return None
        key = self.plan_key
        found = RECORDS.decode(
            key,
            self.store.get(key),
            lambda doc: (verified(doc, self.secret, "plan change"), doc)[1],
        )
        return found if found is not None else (previous.plan if previous is not None else None)

    def _write(self, gen: Generation, step: int, proposed: Decision) -> Decision:
        """Propose ``proposed`` for ``step`` under ``gen``; the decision written first stands."""
        proposal = signed_json(
            {
                "gen": gen.gen,
                "step": step,
                "commit": proposed.commit,
                "next": proposed.next.to_dict(),
                "joined": [[m.replica, m.attempt] for m in proposed.joined],
                "plan": proposed.plan,
                "seen": proposed.seen,
            },
            self.secret,
        )
        key = self._key("decision", gen.gen, step)
        value = self.store.compare_set(key, "", proposal)
        for _ in range(_REPLACE_TRIES):
            if (decision := self._parse(key, value, step, gen.gen)) is not None:
                break
            # a value the job did not sign (another process wrote it) is replaced, atomically: the
            # decision of a decider of the job that replaced it first stands
            value = self.store.compare_set(key, value, proposal)
        else:
            raise QuorumLost(
                f"store key {key}: the decision of step {step} could not be written "
                "(another process keeps writing there)"
            )
        if value.decode() == proposal:  # this rank's proposal stands: say what follows from it
            self.complete(gen, decision, only_missing=False)
        return decision

    def complete(self, gen: Generation, decision: Decision, only_missing: bool = True) -> None:
        """Write what follows from ``decision``: next generation, admissions, commit record.

        Its decider writes them right after the decision and may die in between (a replica lost
        mid-commit); the supervisor's chain then writes those missing. Without the commit record
        every reader of the membership would wait for that step forever, without the admission a
        returning replica would. The same values either way; the latest generation never goes
        back.

        Args:
            gen: the generation the decision was made under.
            decision: the step's decision.
            only_missing: write only the keys not there yet (False: the decider's own write, no
                reads on its path).
        """

        def put(key: str, value: str) -> bool:
            if only_missing and self.store.check([key]):
                return False
            self.store.set(key, value)
            return True

        nxt = decision.next
        if nxt.gen != gen.gen and put(
            self._key("gen", nxt.gen), signed_json(nxt.to_dict(), self.secret)
        ):
            latest = self._key("gen", "latest")
            if (
                not only_missing
                or not self.store.check([latest])
                or (checked_int(self.store.get(latest), latest) or -1) < nxt.gen
            ):
                self.store.set(latest, str(nxt.gen))
        for m in decision.joined:
            put(
                self._key("admitted", m.replica, m.attempt),
                signed_json(
                    {"replica": m.replica, "attempt": m.attempt, "gen": nxt.gen}, self.secret
                ),
            )
        if decision.commit:
            put(self._key("committed", decision.step), json.dumps(gen.replicas))

    def _requests(self) -> list[int]:
        return [r for r in range(self._replicas()) if self.store.check([self._key("join", r)])]

    def _replicas(self) -> int:
        key = self._key("replicas")
        return (checked_int(self.store.get(key), key) or 0) if self.store.check([key]) else 0

    def set_replicas(self, dp: int) -> None:
        self.store.set(self._key("replicas"), str(dp))

    def _read(self, key: str, step: int, gen: int) -> Decision | None:
        return self._parse(key, self.store.get(key), step, gen)

    def _parse(self, key: str, value: bytes, step: int, gen: int) -> Decision | None:
        """The decision at ``key``; None (warned once) where it is not the job's."""
        try:
            data = authority(
                "quorum decision",
                {"commit": bool, "next": dict, "joined": list},
                {"plan": dict, "seen": int},
                secret=self.secret,
                same={"gen": gen, "step": step},
            )(load_json(value))
            return Decision(
                step,
                data["commit"],
                Generation.from_dict(data["next"]),
                tuple(Member(int(r), int(a)) for r, a in data["joined"]),
                data.get("plan"),
                int(data.get("seen", -1)),
            )
        except (RecordError, TypeError, ValueError, KeyError) as exc:
            RECORDS.reject(key, exc)
            return None

    def decided(self, gen: Generation, step: int) -> bool:
        """Whether ``step`` under ``gen`` is decided already (before this rank voted: an abort)."""
        return self.store.check([self._key("decision", gen.gen, step)])

    def decision(self, gen: int, step: int) -> Decision | None:
        key = self._key("decision", gen, step)
        return self._read(key, step, gen) if self.store.check([key]) else None

    def decisions(self, start: Generation) -> Iterator[Decision]:
        """The decisions written so far, in order, from generation ``start``'s first step."""
        gen, step = start.gen, start.from_step
        while (d := self.decision(gen, step)) is not None:
            yield d
            gen, step = d.next.gen, d.next.from_step

    def admitting(self, gen: Generation) -> Decision | None:
        """The commit that admitted a returning replica into ``gen``.

        A join changes the generation: it was decided under ``gen.gen - 1``, at the step before
        ``gen.from_step``."""
        return self.decision(gen.gen - 1, gen.from_step - 1)

    def finish(self, step: int) -> None:
        """The job trained its last step: a replica still catching up stops instead of waiting."""
        self.store.set(self._key("finished"), str(step))

    def finished(self) -> bool:
        return self.store.check([self._key("finished")])


class DecisionChain:
    """The supervisor's walk along the decisions, up to the attempt in flight.

    Each decision names the generation and step of the next attempt: the attempt in flight is where
    an abort goes when a member is evicted."""

    def __init__(self, quorum: Quorum, start: Generation) -> None:
        self.quorum, self.gen, self.step = quorum, start, start.from_step

    def advance(self) -> None:
        while (d := self.quorum.decision(self.gen.gen, self.step)) is not None:
            self.quorum.complete(self.gen, d)
            self.gen, self.step = d.next, d.next.from_step

    def abort_evicted(self) -> None:
        """Abort the attempt in flight where it names an evicted member.

        Such a member was admitted by a decider that read the join before the eviction and wrote
        after it, while ``abort_for`` found the chain before that decision (the survivors would wait
        on a dead replica)."""
        self.advance()
        for member in self.gen.members:
            if self.quorum.is_evicted(member):
                self.abort_for(member)
                self.advance()
                return

    def abort_for(self, member: Member) -> Decision | None:
        """Abort the attempt in flight if evicted ``member`` takes part in it.

        So no survivor waits on it; unless a decision that leaves it out is there first."""
        while True:
            self.advance()
            if member not in self.gen.members:
                return None
            d = self.quorum._decide(self.gen, self.step, commit=False)
            if not d.commit:
                return d
