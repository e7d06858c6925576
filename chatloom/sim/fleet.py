"""A fleet as cells: run some or all of them (in parallel processes) and pool the figures.

A cell is a router over `cell_size` replicas; each conversation belongs to one cell (the gateway
hashes its id), so cells share nothing and behave alike. Simulating every cell is the whole fleet;
simulating `sample_cells` of them, each at its share of the fleet's traffic, estimates the fleet's
percentiles and rates from that sample (rates are scaled back up by fleet/simulated replicas).
A simulation's cost grows with the requests simulated, not with the fleet's nominal size.
"""
from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
from dataclasses import dataclass, replace
from typing import Callable

from chatloom.serving.policies import make_policy as serving_make_policy
from chatloom.serving.routing import RoutingPolicy
from chatloom.sim.hardware import ReplicaSpec
from chatloom.sim.request_table import RequestTable
from chatloom.sim.early_stop import EarlyStop
from chatloom.sim.simulator import SimConfig, SimRun, Simulator
from chatloom.sim.arrivals import TrafficModel

PolicySpec = str | Callable[[], RoutingPolicy]


def make_policy(spec: PolicySpec) -> RoutingPolicy:
    """A fresh routing policy: by its settings name (the serving room's make_policy), or from a factory."""
    if callable(spec):
        return spec()
    return serving_make_policy(spec)


@dataclass
class ReplicaStats:
    busy_time: float
    usage_time: float
    peak_usage: float
    steps: int
    tokens_generated: int
    span_s: float = 0.0  # simulated seconds the replica existed (the run's end, drain included)


def replica_stats(run) -> list[ReplicaStats]:
    """The figures each replica of a finished SimRun keeps."""
    return [ReplicaStats(r.busy_time, r.usage_time, r.peak_usage, r.steps, r.tokens_generated, run.sim_seconds)
            for r in run.replicas]


@dataclass
class CellResult:
    table: RequestTable
    replicas: list[ReplicaStats]
    sim_seconds: float
    wall_seconds: float
    events: int
    stopped: bool = False  # ended early (EarlyStop): what was in flight is unfinished
    stop_reason: str = ""  # then why: "missed", "meets" or "first tokens"


def cell_result(run: SimRun) -> CellResult:
    return CellResult(run.table, replica_stats(run), run.sim_seconds, run.wall_seconds, run.events, run.stopped,
                      run.stop_reason)


def cell_simulator(spec: ReplicaSpec, cell_size: int, policy: PolicySpec, traffic: TrafficModel, config: SimConfig,
                   progress: Callable[[float], None] | None = None, name_prefix: str = "r",
                   early_stop: EarlyStop | None = None) -> Simulator:
    """One cell's simulator, keeping no request past its end (its figures go to the run's table)."""
    return Simulator(spec, cell_size, make_policy(policy), traffic, config, progress=progress, name_prefix=name_prefix,
                     keep_requests=False, early_stop=early_stop)


def run_cell(spec: ReplicaSpec, cell_size: int, policy: PolicySpec, traffic: TrafficModel, config: SimConfig,
             progress: Callable[[float], None] | None = None, name_prefix: str = "r",
             early_stop: EarlyStop | None = None) -> CellResult:
    return cell_result(cell_simulator(spec, cell_size, policy, traffic, config, progress, name_prefix, early_stop).run())


_progress_queue = None


def _init_worker(q) -> None:
    global _progress_queue
    _progress_queue = q


def _cell_worker(args) -> CellResult:
    spec, cell_size, policy, traffic, config, index = args
    q = _progress_queue
    return run_cell(spec, cell_size, policy, traffic, config, progress=(lambda dt: q.put(dt)) if q else None,
                    name_prefix=f"c{index}r")


@dataclass
class FleetResult:
    cells: list[CellResult]
    fleet_size: int
    cell_size: int
    wall_seconds: float

    @property
    def table(self) -> RequestTable:
        return RequestTable.concat([c.table for c in self.cells])

    @property
    def replicas(self) -> list[ReplicaStats]:
        return [r for c in self.cells for r in c.replicas]

    @property
    def replicas_simulated(self) -> int:
        return len(self.replicas)


def run_fleet(spec: ReplicaSpec, fleet_size: int, policy: PolicySpec, traffic: TrafficModel, config: SimConfig,
              cell_size: int | None = None, sample_cells: int | None = None, processes: int = 1,
              show_progress: bool = False) -> FleetResult:
    """Simulate `sample_cells` cells of `cell_size` replicas (default: the whole fleet as one cell),
    each cell getting cell_size/fleet_size of `traffic`, with its own seed."""
    if fleet_size < 1:
        raise ValueError("the fleet needs at least one replica")
    cell_size = min(cell_size or fleet_size, fleet_size)
    num_cells = -(-fleet_size // cell_size)
    sample = min(sample_cells or num_cells, num_cells)
    share = cell_size / fleet_size
    jobs = [(spec, cell_size, policy, traffic.scaled(share), replace(config, seed=config.seed * 1000 + i), i)
            for i in range(sample)]
    bar = None
    if show_progress:
        from tqdm import tqdm
        bar = tqdm(total=round(config.duration_s * sample), unit="sim-s", desc=f"simulating {sample} cell(s)",
                   smoothing=0.05)
    shown = [0.0, 0]  # simulated seconds reported, whole seconds shown

    def advance(dt: float) -> None:
        shown[0] += dt
        whole = int(shown[0]) - shown[1]
        if whole > 0:
            shown[1] += whole
            bar.update(whole)
    t0 = time.perf_counter()
    if processes <= 1 or sample == 1:
        cells = []
        for job in jobs:
            cells.append(run_cell(*job[:5], progress=advance if bar else None,
                                  name_prefix=f"c{job[5]}r"))
    else:
        q = mp.Queue() if bar else None
        with mp.Pool(min(processes, sample), initializer=_init_worker, initargs=(q,)) as pool:
            pending = pool.map_async(_cell_worker, jobs)
            while not pending.ready():
                if q is None:
                    pending.wait(0.5)
                    continue
                try:
                    advance(q.get(timeout=0.5))
                except queue_mod.Empty:
                    pass
            cells = pending.get()
    if bar:
        bar.close()
    return FleetResult(cells, fleet_size, cell_size, time.perf_counter() - t0)
