"""Prefill/decode disaggregation (DistServe, Splitwise), by simulation.

Two pools of replicas on the same kind of node: prefill replicas run prompts (large token budget) and
make each answer's first token; the prompt's KV then crosses the network (bytes = prompt tokens x KV
bytes per token, at the link's bandwidth, plus a fixed latency) to a decode replica, which takes it
straight into its running batch and writes the rest. Decode steps never wait behind a prefill, so
TPOT is steadier; the price is the transfer, fewer replicas doing each job, and the decode pool's
memory filling up on its own. `compare` runs this against colocated replicas on the same number of
nodes and the same traffic.
"""
from __future__ import annotations

from dataclasses import replace

from chatloom.serving.routing import NoReplicaAvailable, RouteRequest
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.replica import SimReplica, SimRequest
from chatloom.sim.simulator import SimConfig, Simulator, new_replicas

_TRANSFER = 10


class DisaggSimulator(Simulator):
    def __init__(self, spec: ReplicaSpec, num_prefill: int, num_decode: int, prefill_policy, decode_policy,
                 traffic, config: SimConfig, link_bytes_per_s: float = 50e9, link_latency_s: float = 0.001,
                 prefill_budget: int | None = None, progress=None, name_prefix: str = "") -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("disaggregation needs at least one prefill and one decode replica")
        if spec.kv_bytes_per_token <= 0:
            raise ValueError("disaggregation needs the model's KV bytes per token (for the transfer cost)")
        if link_bytes_per_s <= 0:
            raise ValueError("the KV link bandwidth must be positive")
        prefill_spec = replace(spec, max_num_batched_tokens=prefill_budget or max(spec.max_num_batched_tokens, 8192))
        super().__init__(prefill_spec, num_prefill, prefill_policy, traffic, config, progress=progress,
                         name_prefix=f"{name_prefix}p")
        self.prefill = self.replicas
        self.decode = new_replicas(f"{name_prefix}d", num_decode, spec, config)
        for r in self.prefill:
            r.on_first_token = self._handoff
        for r in self.decode:
            r.on_finish = self._finished
        self.by_name.update({r.name: r for r in self.decode})
        self._decode_names = {r.name for r in self.decode}
        self.replicas = self.prefill + self.decode
        self.decode_policy = decode_policy
        self.link_bytes_per_s = link_bytes_per_s
        self.link_latency_s = link_latency_s
        self.kv_bytes_per_token = spec.kv_bytes_per_token
        self.transfers = 0
        self.transfer_seconds = 0.0

    def states(self, keys, prompt_tokens: int = 0):
        # The prefill router sees the prefill pool only.
        saved, self.replicas = self.replicas, self.prefill
        try:
            return super().states(keys, prompt_tokens)
        finally:
            self.replicas = saved

    def warm_targets(self) -> list[SimReplica]:
        # A conversation's next prompt goes to a prefill replica: that is where its history helps.
        return self.prefill

    def answer_targets(self) -> list[SimReplica]:
        return self.decode

    def _handoff(self, req: SimRequest, now: float) -> bool:
        if len(req.answer) < 2:
            return False  # the first token was the whole answer
        seconds = self.link_latency_s + len(req.prompt) * self.kv_bytes_per_token / self.link_bytes_per_s
        self.transfers += 1
        self.transfer_seconds += seconds
        self._push(now + seconds, _TRANSFER, req)
        return True

    def _dispatch(self, kind: int, obj, t: float) -> None:
        if kind != _TRANSFER:
            super()._dispatch(kind, obj, t)
        req = obj
        rr = RouteRequest(prompt_tokens=len(req.prompt) + 1, block_keys=req.block_keys, model=self.spec.model_key)
        saved, self.replicas = self.replicas, self.decode
        try:
            states = Simulator.states(self, req.block_keys)
        finally:
            self.replicas = saved
        try:
            name = self.decode_policy.choose(rr, states)
        except NoReplicaAvailable:
            req.refused = "no_replica"
            self._next_turn(req, t)
            return
        self.decode_policy.routed(rr, name)
        replica = self.by_name[name]
        replica.inbox.append(req)  # taken into the batch at its next step boundary
        self._kick(replica, t)
