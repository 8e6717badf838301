"""One .ckpt file from a sharded checkpoint directory (vit.sharding.ShardedStrategy), which
vit.checkpoint.load_model and --model.finetune.init_from read: `vit.sharding.main`.

    python scripts/consolidate_checkpoint.py runs/x/checkpoints/last.ckpt vit_h14.ckpt
"""

from vit.sharding import main

if __name__ == "__main__":
    main()
