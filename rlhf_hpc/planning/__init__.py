"""What a config means on the hardware before anything runs: a model's sizes (``sizing``), the
FSDP layout and checkpointing chosen (``layout``, by the plans: ``layout_search``), the per-phase
memory plan and the time plan."""

from rlhf_hpc.planning import layout_search  # noqa: F401  (hands the layout its search of fsdp_size)

__all__ = ["layout_search"]
