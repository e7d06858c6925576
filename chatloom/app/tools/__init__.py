"""Server-side tools the chat's model may call: the registry that runs them (every failure becomes a
tool error the model reads), the safe built-ins (calculator, clock, search over the user's own
conversations), the code interpreter in a bubblewrap sandbox, and web search and page fetching.

The answer job (app/chat/answer_job.py) runs them between rounds of one answer. Import from the modules.
"""
