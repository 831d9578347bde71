"""Tensor parallelism's lowest layer: which rank this process is, how a dimension splits across
ranks, and the collectives the sharded layers call (torch.distributed: gloo on CPU, NCCL on
CUDA). The process group is started and watched by `worker/parallel/`; model layers only read
`building_group()` while they are constructed and call `collectives` in their forward pass.
"""
