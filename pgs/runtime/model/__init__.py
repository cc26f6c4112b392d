"""The model side: building a HF causal LM, packed attention, layer wrapping (activation checkpointing,
compile, Liger), tiled MLP."""
