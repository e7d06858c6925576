"""The core room: what every other room of the app stands on. Settings (and the `[[models]]`
fleet setting), authentication (passwords, tokens, API keys, the caller cache), the one error shape
and validation at the edge.

It imports nothing else from chatloom.app.
"""
