"""Vision encoders and their image preprocessing: what turns an image into the embeddings a decoder
reads at its image tokens (Idefics3 / SmolVLM: a SigLIP encoder and a pixel-shuffle connector)."""
