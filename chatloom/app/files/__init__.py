"""Files and retrieval: a user's uploaded documents (PDF, DOCX, Markdown, HTML, source, text), their text
extracted and cut into passages, indexed for full-text search and by embeddings, collections that group
them, attaching them to conversations, and retrieving the passages a new message needs, fused by rank
and fitted to a token budget, with citations. Deleting a file, a conversation or an account removes its
blobs, passages and vectors. May import generation, state, traffic and core."""
