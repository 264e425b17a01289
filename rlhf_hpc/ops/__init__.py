"""Pure functions on tensors: the PPO math (``algos``), batch layouts and micro-batches (``batching``),
metric accumulation (``metrics``)."""
