"""``attn_implementation=varlen`` (rlhf_hpc/models/attention.py): per-sequence attention for packed rows.

On the CPU it runs its reference path (causal sdpa per sequence); the GPU kernel is checked by the
GPU readiness script against sdpa. Here: the same log-probs and gradients as sdpa for packed,
padded and unpadded batches, the sequence boundaries it used, and its selection by config.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.models import attention
from rlhf_hpc.models.hf import attn_implementation, build_causal_lm, build_critic
from rlhf_hpc.ops.batching import make_padded_batch, pack
from rlhf_hpc.ppo.actor import per_token_logprobs
from rlhf_hpc.recipe.load import load_config

URL = "tiny://qwen2?vocab_size=200&num_hidden_layers=2&num_attention_heads=4&num_key_value_heads=2"


def batch(prompt_lens, resp_lens, P, R, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in prompt_lens]
    resps = [torch.randint(1, 200, (n,), generator=g).tolist() for n in resp_lens]
    return make_padded_batch(prompts, resps, 0, P, R)


@pytest.fixture(scope="module")
def models():
    return (
        build_causal_lm(URL, torch.float32, attn="sdpa", seed=3),
        build_causal_lm(URL, torch.float32, attn="varlen", seed=3),
    )


def test_varlen_matches_sdpa_packed_padded_and_unpadded(models):
    sdpa, varlen = models
    assert varlen.config._attn_implementation == "varlen"
    ragged = batch((12, 5, 9), (10, 3, 7), 12, 10)
    full = batch((6, 6), (4, 4), 6, 4)  # no padding at all: sdpa's mask is skipped, varlen takes over
    for b, packed in ((ragged, True), (ragged, False), (full, False)):
        lp_ref, _ = per_token_logprobs(sdpa, b, remove_padding=packed)
        lp, _ = per_token_logprobs(varlen, b, remove_padding=packed)
        assert (lp - lp_ref).abs().max().item() < 1e-5, packed
    # the packed row is split where the sequences are: by the packing's own metadata, and the same
    # found from the position ids where a caller passes none
    lens = ragged["attention_mask"].sum(-1)
    packed = pack(ragged)
    assert packed.cu_seqlens.tolist() == [0] + torch.cumsum(lens, 0).tolist() and packed.max_len == int(lens.max())
    cu, longest = attention.packing_metadata(packed.position_ids, 1, packed.position_ids.shape[1], {})
    assert cu.tolist() == packed.cu_seqlens.tolist() and longest == packed.max_len


class HostSyncs(TorchDispatchMode):
    """Counts the ops that make a CUDA host wait for the device (a scalar read, a data-dependent size)."""

    SYNCING = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.SYNCING
        return func(*args, **(kwargs or {}))


def test_no_host_sync_per_layer():
    """A packed forward costs the same host syncs with 2 layers as with 6: none is per layer
    (before: the sequence bounds were found again in every layer, 2 syncs each)."""
    b = batch((12, 5, 9), (10, 3, 7), 12, 10)
    counts = {}
    for layers in (2, 6):
        model = build_causal_lm(f"{URL}&num_hidden_layers={layers}", torch.float32, attn="varlen", seed=3)
        for with_metadata in (True, False):
            packed = pack(b)
            kwargs = packed.attention_kwargs() if with_metadata else {}
            with torch.no_grad(), HostSyncs() as syncs:
                model(
                    input_ids=packed.input_ids,
                    position_ids=packed.position_ids,
                    attention_mask=None,
                    use_cache=False,
                    **kwargs,
                )
            counts[layers, with_metadata] = syncs.count
    assert counts[2, True] == counts[6, True] and counts[2, False] == counts[6, False], counts
    assert counts[2, False] > counts[2, True]  # finding the bounds from position ids syncs (once per forward)


def test_sequences_of_equal_length_share_one_batched_call(models):
    """Packed sequences are grouped by length (one sdpa call per distinct length): the same
    log-probs as sdpa when all lengths are equal, when some repeat, and when all differ."""
    sdpa, varlen = models
    cases = [
        ((6, 6, 6), (4, 4, 4)),  # one length: the row is a batch as it is
        ((6, 6, 3, 6, 3), (4, 4, 2, 4, 5)),  # lengths 10, 10, 5, 10, 8: groups of 3, 1, 1
        ((2, 5, 7), (1, 3, 6)),
    ]  # all different
    for prompt_lens, resp_lens in cases:
        b = batch(prompt_lens, resp_lens, max(prompt_lens), max(resp_lens), seed=5)
        lp_ref, _ = per_token_logprobs(sdpa, b, remove_padding=True)
        lp, _ = per_token_logprobs(varlen, b, remove_padding=True)
        assert (lp - lp_ref).abs().max().item() < 1e-5, prompt_lens
    q = torch.randn(12, 4, 8, requires_grad=True)
    kv = torch.randn(12, 2, 8)
    cu = torch.tensor([0, 3, 6, 8, 12], dtype=torch.int32)  # lengths 3, 3, 2, 4
    out = attention.per_sequence_attention(q, kv, kv, cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each sequence on its own
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), kv[a:b].transpose(0, 1), kv[a:b].transpose(0, 1), is_causal=True, enable_gqa=True
        ).transpose(0, 1)
        assert torch.allclose(out[a:b], ref, atol=1e-6)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_varlen_gradients_match_sdpa(models):
    sdpa, varlen = models
    b = batch((12, 5, 9, 2), (10, 3, 7, 10), 12, 10, seed=4)
    for m in models:
        m.zero_grad()
        lp, _ = per_token_logprobs(m, b, remove_padding=True)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    diffs = [(p.grad - q.grad).abs().max().item() for p, q in zip(sdpa.parameters(), varlen.parameters())]
    assert max(diffs) < 1e-5


def test_sequence_starts_of_packed_positions():
    # two rows: a packed row of lengths 3, 2, 4 and a row whose positions start mid-sequence
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 7, 8, 0, 1, 2, 3, 4]])
    cu, longest = attention.sequence_starts(pos)
    assert cu.tolist() == [0, 3, 5, 9, 13, 18] and cu.dtype == torch.int32
    assert longest == 5
    p = pack(batch((4, 2), (3, 3), 4, 3))
    cu, _ = attention.sequence_starts(p.position_ids)
    assert cu.tolist() == [0, 7, 12]


def test_varlen_is_chosen_by_verl_override_key_and_validated():
    cfg, _ = load_config("tiny_klppo", ["actor_rollout_ref.model.override_config.attn_implementation=varlen"])
    mcfg = cfg.actor_rollout_ref.model
    assert attn_implementation(torch.device("cpu"), mcfg.override_config) == "varlen"
    # the CPU default is varlen as well (packed rows without a dense mask); sdpa only when asked for
    assert attn_implementation(torch.device("cpu"), cfg.critic.model.override_config) == "varlen"
    assert attn_implementation(torch.device("cpu"), {"attn_implementation": "sdpa"}) == "sdpa"
    critic = build_critic(URL, torch.float32, attn="varlen", seed=1)
    assert critic.model.config._attn_implementation == "varlen"
    with pytest.raises(
        ConfigError, match=r"critic.model.override_config.attn_implementation='varlne'.*did you mean 'varlen'"
    ):
        load_config("tiny_klppo", ["critic.model.override_config.attn_implementation=varlne"])


def test_kernel_arguments_fit_this_torchs_varlen_kernel():
    """The GPU kernel cannot run here, but its call can be bound against this torch's signature
    (torch 2.11 has window_size and no enable_gqa; later releases add enable_gqa)."""
    import inspect

    kernel = attention._kernel()
    if kernel is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    q = torch.zeros(10, 4, 32)
    for heads, kv_heads in ((4, 4), (4, 2)):
        kw, repeat = attention.kernel_arguments(kernel, 0.125, heads, kv_heads)
        k = torch.zeros(10, kv_heads * repeat, 32)
        assert kv_heads * repeat == heads or kw.get("enable_gqa")
        bound = inspect.signature(kernel).bind(
            q, k, k, torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32), 5, 5, **kw
        )
        causal = bound.arguments.get("is_causal") or bound.arguments.get("window_size") == (-1, 0)
        assert causal and bound.arguments["scale"] == 0.125


def test_a_gpu_without_a_working_flash_attn_uses_varlen_and_says_so():
    """Never sdpa on a GPU (a dense block-diagonal mask over packed rows): this machine has no
    flash-attn, so a CUDA device gets varlen with a warning naming the reason."""
    from rlhf_hpc.models.hf import flash_attn_problem

    problem = flash_attn_problem()
    if problem is None:
        pytest.skip("flash-attn imports here")
    with pytest.warns(UserWarning, match=r"packed rows use attn_implementation=varlen"):
        assert attn_implementation(torch.device("cuda")) == "varlen"
    assert attn_implementation(torch.device("cuda"), {"attn_implementation": "sdpa"}) == "sdpa"  # explicit wins


def test_bf16_attention_on_the_host_computes_in_fp32():
    """In bf16 on the CPU, varlen computes attention in fp32 (the host's bf16 sdpa backward is ~3x
    slower) and returns bf16: outputs and input gradients equal, bit for bit, fp32 attention on the
    same bf16 inputs rounded once to bf16 (bf16 sdpa rounds inside and would not)."""
    g = torch.Generator().manual_seed(0)
    H, Hkv, D, lens = 4, 2, 16, (7, 12, 7)
    N = sum(lens)
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lens), 0).tolist()], dtype=torch.int32)
    pos = torch.cat([torch.arange(n) for n in lens]).view(1, N)
    q, k, v = (torch.randn(1, h, N, D, generator=g).to(torch.bfloat16).requires_grad_() for h in (H, Hkv, Hkv))
    out, _ = attention.varlen_attention_forward(None, q, k, v, None, position_ids=pos, scaling=D**-0.5)
    assert out.dtype == torch.bfloat16
    w = torch.randn(out.shape, generator=g).to(torch.bfloat16).float()  # exact in bf16: both see one gradient
    (out.float() * w).sum().backward()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention.per_sequence_attention(
        *(t.transpose(1, 2).reshape(N, -1, D) for t in (q32, k32, v32)), cu, D**-0.5
    ).reshape(1, N, H, D)
    (ref * w).sum().backward()
    assert torch.equal(out, ref.to(torch.bfloat16))
    for t, t32 in ((q, q32), (k, k32), (v, v32)):
        assert t.grad.dtype == torch.bfloat16
        assert torch.equal(t.grad, t32.grad.to(torch.bfloat16))
