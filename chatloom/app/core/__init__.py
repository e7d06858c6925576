"""The core room: what every other room of the app stands on. The `[[models]]` fleet setting and the
generated configuration reference (the settings themselves are the tree in chatloom/settings/),
authentication (passwords, tokens, API keys, the caller cache), the one error shape and validation at
the edge.

It imports nothing else from chatloom.app.
"""
