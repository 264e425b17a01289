"""What a run reports: timers and memory (``perf``), loggers (``tracking``), the communication
share and traces (``profiling``), ``launch.py compare``, library log routing."""
