"""What a config means on the hardware before anything runs: a model's sizes (``sizing``), the
FSDP layout and checkpointing chosen (``layout``), the per-phase memory plan."""
