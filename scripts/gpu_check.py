"""Check every GPU path (bf16 fits eager and compiled, flash attention, channels-last ResNet-50,
sharded and NCCL DDP training) and print img/s, peak memory and MFU: `vit.tools.gpu_check`.
Without a CUDA GPU it says so and exits 0; `--help` lists the options (`--device cpu` for a debug run).
"""

from vit.tools.gpu_check import cli

if __name__ == "__main__":
    cli()
