"""The traffic room: service tiers, token quotas, the admission queue, the reasoning class,
moderation (local lexicon and remote), metering and the Prometheus metrics, wired together in
`control.Traffic`.

It depends only on core/ (and serving/ for figures); every room above may use it.
"""
