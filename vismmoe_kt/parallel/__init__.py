"""Expert parallelism over torch.distributed (NCCL on GPUs, gloo for CPU tests; launched by torchrun)."""
