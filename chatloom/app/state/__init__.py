"""The state room: hot state shared by the gateways of a fleet (quotas, stream event logs, stop
signals, job leases and admission shares), the journal that puts streamed answer text in the database
before readers get it, and the background loops that keep it. In memory for one process (the
default); in Redis when `shared_state.redis_url` is set, so any gateway can serve any request (see
DESIGN.md, Scale-out shape).

It builds on traffic/ (quota stores) and core/.
"""
