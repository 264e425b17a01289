"""Generation engines behind one interface (``base.RolloutEngine``): ``vllm`` and ``hf``;
``factory.make_engine`` builds the one the config names."""
