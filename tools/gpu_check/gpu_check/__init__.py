"""tools/gpu_check: a one-GPU check of plait's FSDP2 path (throughput, MFU, memory against plan)."""
