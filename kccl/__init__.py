"""KCCL: in-kernel communication. sync.py holds the device-side signal / wait primitives (inline PTX on the GPU,
plain atomics under TRITON_INTERPRET=1) that the monokernel uses between its tasks and that cross-GPU
collectives use on peer memory (SYS=True)."""
