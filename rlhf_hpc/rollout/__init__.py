"""Generation engines behind one interface (``base.RolloutEngine``): ``vllm`` and ``hf``."""
