"""The generation room: the one pipeline every API front uses for a generation (caps, input
moderation, quota reservation, admission, the stream with its output guard, settling the quota and
metering at the end), and function calling (tools described to the model, calls found in its output).

It builds on traffic/ and core/; it knows nothing of conversations or of the API that called it.
"""
