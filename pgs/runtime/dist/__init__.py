"""Several processes: the FSDP2 process group and mesh, and the torchrun launcher."""
