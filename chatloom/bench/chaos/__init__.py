"""`chatloom bench chaos`: two HTTP/2 gateways, three replicas, a PostgreSQL and a Redis of the run's
own on loopback, under mixed traffic and a seeded schedule of faults, then the invariants that must
hold (docs/chaos.md). One module per job: services and processes (the topology), traffic (the users),
faults (schedule and injection), resources (/proc sampling), invariants (the checks), report (table
and JSON), run (the whole)."""
