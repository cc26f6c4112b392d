"""What a run writes to disk: checkpoints (single-process and DCP) and the HF export."""
