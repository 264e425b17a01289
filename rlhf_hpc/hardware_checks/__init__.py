"""What this machine can do, measured on it: the CPU calibration the time plan reads
(``launch.py calibrate``) and the GPU readiness check (``launch.py gpu-check``)."""
