"""The fleet simulator and capacity planner.

Runs the engine's real Scheduler and KV-cache manager and the serving room's routing policies in
simulated time, with a step-time model standing in for the GPUs, so "how many replicas, which
policy, which SLO" can be answered before buying hardware. Loads no weights.

Modules: step_time (how long a step takes), hardware (GPUs, nodes, KV pools), traffic (who sends
what, when), replica (one simulated engine), simulator (the event loop and the router in front),
report (percentiles, goodput), disagg (prefill/decode pools), seeds (the back-of-envelope sizing),
planner (the smallest fleet meeting an SLO), plots, cli.
"""
