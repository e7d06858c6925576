"""Which gateway runs each conversation's answer: a job record and a lease.

One answer runs per conversation at a time, whichever gateway received it. `claim` takes the
conversation (or says another gateway holds it: a 409); the job record then says what is running
(the answer's message id and what a takeover needs to continue it). The holder renews its lease
every `lease_s / 3`; a gateway that dies stops renewing, the lease lapses, and another gateway finds
the job in `lapsed()` and `take`s it, atomically, so exactly one continues it.

Each process also has an instance id (unique per start, even where gateways are named in the settings),
written beside every answer it writes. `RedisJobs` keeps a liveness key per instance, renewed with the
leases and gone `lease_s` after the process stops, so `alive` says exactly whose answers were left by a
dead process (see recovery.py); alone (`MemoryJobs`), only this process is alive.

`MemoryJobs` serves one process (a lease cannot lapse while the process lives); `RedisJobs` a fleet.
"""
from __future__ import annotations

import abc
import json
import uuid
from dataclasses import dataclass, field

import redis.asyncio as redis


@dataclass
class JobRecord:
    conversation_id: str
    gateway: str
    message_id: str | None = None  # the answer being written (None while it is being set up)
    spec: dict = field(default_factory=dict)  # what a takeover needs to continue the answer

    def dumps(self) -> str:
        return json.dumps({"conversation_id": self.conversation_id, "gateway": self.gateway,
                           "message_id": self.message_id, "spec": self.spec})

    @classmethod
    def loads(cls, raw: str | bytes) -> "JobRecord":
        return cls(**json.loads(raw))


def new_instance_id(gateway: str) -> str:
    """This process's id: the gateway's name and a random part, so a restart under the same name differs."""
    return f"{gateway[:100]}/{uuid.uuid4().hex[:12]}"


class Jobs(abc.ABC):
    gateway: str
    instance: str
    lease_s: float

    @abc.abstractmethod
    async def alive(self, instances: set[str]) -> set[str]:
        """The instances (of those given) whose process is alive."""

    @abc.abstractmethod
    async def claim(self, conversation_id: str) -> bool:
        """Hold the conversation for a new answer; False if an answer runs (or awaits takeover) there."""

    @abc.abstractmethod
    async def update(self, record: JobRecord) -> None:
        """Record what this gateway's job is (its answer and how to continue it)."""

    @abc.abstractmethod
    async def release(self, conversation_id: str) -> None:
        """The answer ended (saved): the conversation is free."""

    @abc.abstractmethod
    async def holder(self, conversation_id: str) -> JobRecord | None: ...

    @abc.abstractmethod
    async def renew(self) -> list[str]:
        """Extend this gateway's leases; returns the conversations whose lease was lost meanwhile."""

    @abc.abstractmethod
    async def lapsed(self) -> list[JobRecord]:
        """Jobs whose gateway stopped renewing."""

    @abc.abstractmethod
    async def take(self, conversation_id: str) -> JobRecord | None:
        """Become the holder of a lapsed job (None: another gateway was faster, or it ended)."""


class MemoryJobs(Jobs):
    def __init__(self, gateway: str = "local", lease_s: float = 10.0, instance: str | None = None) -> None:
        self.gateway = gateway
        self.instance = instance or new_instance_id(gateway)
        self.lease_s = lease_s
        self._jobs: dict[str, JobRecord] = {}

    async def alive(self, instances: set[str]) -> set[str]:
        return instances & {self.instance}  # alone: every other process that wrote here has stopped

    async def claim(self, conversation_id: str) -> bool:
        if conversation_id in self._jobs:
            return False
        self._jobs[conversation_id] = JobRecord(conversation_id, self.gateway)
        return True

    async def update(self, record: JobRecord) -> None:
        self._jobs[record.conversation_id] = record

    async def release(self, conversation_id: str) -> None:
        self._jobs.pop(conversation_id, None)

    async def holder(self, conversation_id: str) -> JobRecord | None:
        return self._jobs.get(conversation_id)

    async def renew(self) -> list[str]:
        return []

    async def lapsed(self) -> list[JobRecord]:
        return []

    async def take(self, conversation_id: str) -> JobRecord | None:
        return None


# KEYS: job, lease, index. ARGV: conversation id, record, gateway, lease ms.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3], 'PX', ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
return 1
"""
# Only the holder writes its record or lets the job go.
_UPDATE = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SREM', KEYS[3], ARGV[1])
return 1
"""
# A lease that lapsed with nobody taking the job (Redis restarted, its keys expired or gone meanwhile)
# is taken back by the gateway still running the answer, its record written again if Redis lost it.
_RENEW = """
local lease = redis.call('GET', KEYS[1])
if lease == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
if lease then return 0 end
local record = redis.call('GET', KEYS[2])
if not record then
  redis.call('SET', KEYS[2], ARGV[3])
  redis.call('SADD', KEYS[3], ARGV[4])
elseif cjson.decode(record)['gateway'] ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
# A job is taken only while its lease is lapsed: the first gateway to run this wins.
_TAKE = """
local record = redis.call('GET', KEYS[1])
if not record then redis.call('SREM', KEYS[3], ARGV[1]) return false end
if redis.call('EXISTS', KEYS[2]) == 1 then return false end
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return record
"""


class RedisJobs(Jobs):
    def __init__(self, client: redis.Redis, gateway: str, prefix: str = "chatloom", lease_s: float = 3.0,
                 instance: str | None = None) -> None:
        self.client = client
        self.gateway = gateway
        self.instance = instance or new_instance_id(gateway)
        self.prefix = prefix
        self.lease_s = lease_s
        self._mine: dict[str, JobRecord] = {}  # the jobs this gateway runs, as last written
        self._claim = client.register_script(_CLAIM)
        self._update = client.register_script(_UPDATE)
        self._release = client.register_script(_RELEASE)
        self._renew = client.register_script(_RENEW)
        self._take = client.register_script(_TAKE)

    @property
    def _index(self) -> str:
        return f"{self.prefix}:jobs"

    def _keys(self, conversation_id: str) -> list[str]:
        return [f"{self.prefix}:job:{conversation_id}", f"{self.prefix}:lease:{conversation_id}", self._index]

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.lease_s * 1000))

    def _alive_key(self, instance: str) -> str:
        return f"{self.prefix}:alive:{instance}"

    async def alive(self, instances: set[str]) -> set[str]:
        order = sorted(instances)
        if not order:
            return set()
        async with self.client.pipeline(transaction=False) as pipe:
            for instance in order:
                pipe.exists(self._alive_key(instance))
            found = await pipe.execute()
        return {i for i, n in zip(order, found) if n}

    async def claim(self, conversation_id: str) -> bool:
        record = JobRecord(conversation_id, self.gateway)
        won = await self._claim(keys=self._keys(conversation_id),
                                args=[conversation_id, record.dumps(), self.gateway, self._lease_ms])
        if won:
            self._mine[conversation_id] = record
        return bool(won)

    async def update(self, record: JobRecord) -> None:
        record.gateway = self.gateway
        if record.conversation_id in self._mine:
            self._mine[record.conversation_id] = record
        await self._update(keys=self._keys(record.conversation_id)[:2], args=[self.gateway, record.dumps()])

    async def release(self, conversation_id: str) -> None:
        self._mine.pop(conversation_id, None)
        await self._release(keys=self._keys(conversation_id), args=[conversation_id, self.gateway])

    async def holder(self, conversation_id: str) -> JobRecord | None:
        raw = await self.client.get(self._keys(conversation_id)[0])
        return JobRecord.loads(raw) if raw else None

    async def renew(self) -> list[str]:
        await self.client.set(self._alive_key(self.instance), self.gateway, px=self._lease_ms)
        lost = []
        for cid, record in list(self._mine.items()):
            job, lease, index = self._keys(cid)
            if not await self._renew(keys=[lease, job, index], args=[self.gateway, self._lease_ms, record.dumps(), cid]):
                lost.append(cid)
                self._mine.pop(cid, None)
        return lost

    async def lapsed(self) -> list[JobRecord]:
        out = []
        for raw_cid in await self.client.smembers(self._index):
            cid = raw_cid.decode()
            job, lease, _ = self._keys(cid)
            raw, held = await self.client.get(job), await self.client.exists(lease)
            if raw is None:
                await self.client.srem(self._index, cid)
            elif not held:
                out.append(JobRecord.loads(raw))
        return out

    async def take(self, conversation_id: str) -> JobRecord | None:
        raw = await self._take(keys=self._keys(conversation_id),
                               args=[conversation_id, self.gateway, self._lease_ms])
        if not raw:
            return None
        record = JobRecord.loads(raw)
        record.gateway = self.gateway
        self._mine[conversation_id] = record
        await self.update(record)
        return record

    def forget(self, conversation_id: str) -> None:
        """Stop renewing (a gateway that hands its jobs over on shutdown lets the leases lapse)."""
        self._mine.pop(conversation_id, None)
