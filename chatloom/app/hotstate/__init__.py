"""Hot state shared by the gateways of a fleet: quotas, stream event logs, stop signals, job leases
and admission shares. In memory for one process (the default); in Redis when `redis_url` is set, so
any gateway can serve any request (see DESIGN.md, Scale-out shape)."""
