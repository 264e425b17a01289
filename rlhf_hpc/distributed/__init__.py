"""Ranks and meshes: the process group, collectives timed per phase (``comm``), FSDP2
(``fsdp.parallelize``), host replicas, sequence parallelism, rows between ranks, loading
pretrained weights once."""
