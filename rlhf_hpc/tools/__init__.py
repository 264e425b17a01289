"""Running untrusted code: the sandbox on a node without root or Docker (bwrap, Apptainer, or a
weaker rlimit-only mode chosen by name), the user's own SandboxFusion service, and the counters of
what the programs did. Serves the code reward (rlhf_hpc/rewards/code.py) and a code tool."""

__all__: list[str] = []  # its modules are imported by their own names
