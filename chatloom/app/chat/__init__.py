"""The chat room: conversations as trees of messages, the branch being read, prompt assembly
(system prompt, summary of older turns, newest turns), summaries, the conversation service that
saves a message and runs its answer as a job, crash recovery and takeover of answers; it runs the server-side tools of app/tools between rounds.

It runs each answer through generation/ and keeps hot state through state/.
"""
