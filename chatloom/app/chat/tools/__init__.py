"""Server-side tools the chat product's model may call: a registry and its safe built-ins.

The orchestrator (app/tool_loop.py) runs them between rounds of one answer. Import from the modules.
"""
