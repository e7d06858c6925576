"""The API room: formats only. Routes, FastAPI dependencies, request and response schemas (the
product's and OpenAI's), OpenAPI declarations, server-sent events framing and readiness checks.

Each API front adapts its format and calls the chat room (conversations) or the generation room
(the one pipeline); nothing below this room knows which API a request came from.
"""
