"""The reward model (rlhf_hpc/rewards/reward_model.py): its scores equal a plain single-process
transformers forward of the same sequence-classification checkpoint on the same texts (within
1e-5), packed or padded, in fixed or token-budget micro-batches, on 1 rank here and on 2 ranks
FSDP-sharded under torchrun (tests/dist_reward_model_checks.py); re-encoding through the reward
model's own chat template; and the reward_model.* keys' validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.config.schema import RewardModelConfig
from rlhf_hpc.models.hf import build_token_scorer
from rlhf_hpc.ops.batching import make_padded_batch
from rlhf_hpc.recipe.load import load_config
from rlhf_hpc.rewards.reward_model import RewardModel
from tests.conftest import REPO, SHARED, require

TOL = 1e-5
TINY_RM = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    num_labels=1,
    pad_token_id=0,
)


def save_tiny_rm(out: Path, vocab_size: int = 64, tokenizer=None) -> Path:
    """A random-weight Qwen2ForSequenceClassification (one label) saved as a checkpoint directory."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(7)
    model = Qwen2ForSequenceClassification(Qwen2Config(**{**TINY_RM, "vocab_size": vocab_size}))
    with torch.no_grad():  # a visible score scale (the default init gives scores ~1e-2)
        model.score.weight.normal_(0, 1.0)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def plain_scores(path: Path, sequences: list[list[int]]) -> torch.Tensor:
    """transformers' own forward, one sequence at a time (no padding anywhere): the reference."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.tensor([model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences])


def random_batch(n: int = 7, P: int = 9, R: int = 6, vocab: int = 64, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in torch.randint(1, P + 1, (n,), generator=g)
    ]
    resps = [
        torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in torch.randint(0, R + 1, (n,), generator=g)
    ]
    resps[0] = []  # an empty response: scored at the prompt's last token
    return make_padded_batch(prompts, resps, 0, P, R), [p + r for p, r in zip(prompts, resps)]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return save_tiny_rm(tmp_path_factory.mktemp("rm") / "tiny-rm")


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("micro,dynamic", [(2, False), (16, False), (None, True)])
def test_scores_equal_a_plain_transformers_forward(rm_dir, packed, micro, dynamic):
    batch, sequences = random_batch()
    cfg = RewardModelConfig(micro_batch_size_per_gpu=micro, use_dynamic_bsz=dynamic, forward_max_token_len_per_gpu=20)
    cfg.model.use_remove_padding = packed
    rm = RewardModel(build_token_scorer(str(rm_dir), torch.float32), cfg)
    got, want = rm.score(batch), plain_scores(rm_dir, sequences)
    assert got.shape == (7,) and got.dtype == torch.float32
    assert (got - want).abs().max().item() < TOL, (got, want)
    assert want.std() > 0.1  # distinct scores: the check would see rows swapped or misread


def test_tiny_reward_model_is_the_same_on_every_build():
    a = build_token_scorer("tiny://qwen2?vocab_size=64", torch.float32, seed=5)
    b = build_token_scorer("tiny://qwen2?vocab_size=64", torch.float32, seed=5)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_multi_label_classifier_is_refused(tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    Qwen2ForSequenceClassification(Qwen2Config(**{**TINY_RM, "num_labels": 2})).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has 2 labels; a reward model scores with one"):
        build_token_scorer(str(tmp_path), torch.float32)


def test_reencoding_through_the_reward_models_chat_template(tmp_path):
    """The actor speaks tiny://chars; the reward model has the Qwen2 tokenizer and template. Each
    response is decoded, appended to its chat and re-encoded: the scores equal a plain forward of
    the Qwen2-templated conversation, and max_length cuts on the right."""
    require("the Qwen2 tokenizer", (SHARED / "assets" / "qwen2-tokenizer").is_dir(), "../shared/assets is missing")
    from transformers import AutoTokenizer

    from rlhf_hpc.data.dataset import chat_token_ids
    from rlhf_hpc.models.tokenizer import build_tiny_tokenizer

    actor_tok, rm_tok = build_tiny_tokenizer(), AutoTokenizer.from_pretrained(SHARED / "assets" / "qwen2-tokenizer")
    path = save_tiny_rm(tmp_path / "rm", vocab_size=len(rm_tok), tokenizer=rm_tok)
    chats = [
        [{"role": "user", "content": "copy: abc"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}],
    ]
    answers = ["abc", "4, it is 4."]
    prompts = [chat_token_ids(actor_tok, c) for c in chats]
    responses = [actor_tok.encode(a) + [actor_tok.eos_token_id] for a in answers]  # ends with <|im_end|>
    batch = make_padded_batch(prompts, responses, actor_tok.pad_token_id, 64, 16)
    texts = [
        rm_tok.apply_chat_template([*c, {"role": "assistant", "content": a}], tokenize=False)
        for c, a in zip(chats, answers)
    ]
    sequences = [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert sequences[0] != prompts[0] + responses[0]  # really another tokenizer
    cfg = RewardModelConfig(micro_batch_size_per_gpu=1, use_dynamic_bsz=False)
    for packed in (True, False):
        cfg.model.use_remove_padding = packed
        rm = RewardModel(build_token_scorer(str(path), torch.float32), cfg, tokenizer=rm_tok, input_tokenizer=actor_tok)
        got = rm.score(batch, chats)
        assert (got - plain_scores(path, sequences)).abs().max().item() < TOL
    cut = RewardModel(rm.model, cfg, tokenizer=rm_tok, input_tokenizer=actor_tok, max_length=10)
    assert (cut.score(batch, chats) - plain_scores(path, [s[:10] for s in sequences])).abs().max().item() < TOL


# ------------------------------------------------------------------------------ 2 ranks, sharded
@pytest.mark.slow
def test_sharded_scores_on_two_ranks_equal_a_plain_forward(rm_dir, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(REPO / "tests" / "dist_reward_model_checks.py"),
            str(rm_dir),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    want = plain_scores(rm_dir, random_batch(n=8)[1])
    for r in ranks:
        assert r["world"] == 2 and r["mesh_dims"] == {**{c: 1 for c in r["scores"]}, "hsdp_2x1": 2}, r
        rows = r["rows"]
        for case, got in r["scores"].items():
            diff = (torch.tensor(got) - want[rows]).abs().max().item()
            assert diff < TOL, (r["rank"], case, diff)
    assert ranks[0]["rows"] != ranks[1]["rows"]  # each rank scored its own rows
    assert {"packed", "padded", "token_budget", "param_offload", "hsdp_2x1"} <= set(ranks[0]["scores"])


# ------------------------------------------------------------------------------ configuration
RM_ON = ["reward_model.enable=true", "reward_model.model.path=tiny://qwen2?vocab_size=64"]


def test_keys_resolve_as_verl_interpolates_them():
    cfg, _ = load_config(
        "tiny_klppo", RM_ON + ["critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=333"]
    )
    rm = cfg.reward_model
    assert rm.use_dynamic_bsz is True and rm.forward_max_token_len_per_gpu == 333
    assert rm.micro_batch_size_per_gpu == cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu
    assert rm.model.fsdp_config.fsdp_size == cfg.trainer.n_gpus_per_node
    off, _ = load_config("tiny_klppo")
    assert off.reward_model.use_dynamic_bsz is None  # nothing filled in for a disabled reward model


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["reward_model.model.path=/some/rm"], "reward_model.model.path is set but reward_model.enable=false"),
        (["reward_model.micro_batch_size_per_gpu=4"], "reward_model.micro_batch_size_per_gpu is set but"),
        (["reward_model.model.fsdp_config.param_offload=true"], "reward_model.model.fsdp_config is set but"),
        (RM_ON + ["reward_model.max_length=64"], "reward_model.max_length=64 cuts re-encoded sequences only"),
        (
            RM_ON + ["reward_model.model.input_tokenizer=Qwen/Qwen2-7B-Instruct"],
            "must be the tokenizer the responses were generated with, the actor's (tiny://chars)",
        ),
        (RM_ON + ["reward_model.model.fsdp_config.optimizer_offload=true"], "the reward model has no optimizer"),
        (RM_ON + ["reward_model.micro_batch_size_per_gpu=0"], "reward_model.micro_batch_size_per_gpu=0 must be > 0"),
        (
            RM_ON + ["reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=16"],
            "reward_model.forward_max_token_len_per_gpu (16) is smaller than one full sequence (40 tokens)",
        ),
        (RM_ON + ["reward_model.model.fsdp_config.mixed_precision.buffer_dtype=bf16"], "buffer_dtype"),
        (RM_ON + ["reward_model.model.path=/no/such/rm"], "reward_model.model.path: '/no/such/rm' does not exist"),
    ],
)
def test_bad_reward_model_keys_are_refused(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny_klppo", overrides)
    assert any(message in line for line in e.value.errors), e.value.errors


def test_good_reward_model_configs_load():
    assert not [w for w in load_config("tiny_klppo", RM_ON)[1] if "strategy" in w]
    _, warnings = load_config("tiny_klppo", RM_ON + ["reward_model.strategy=fsdp"])
    assert [w for w in warnings if w.startswith("reward_model.strategy=fsdp: the engine here is FSDP2")]
    load_config(
        "tiny_klppo",
        RM_ON
        + [
            "reward_model.model.input_tokenizer=tiny://qwen2?vocab_size=64",
            "reward_model.max_length=30",
            "reward_model.model.use_remove_padding=false",
            "reward_model.model.fsdp_config.param_offload=true",
        ],
    )


def test_a_reward_model_with_another_tokenizer_or_template_is_re_encoded_for():
    """With input_tokenizer unset, the reward model still gets its own tokens where the actor's
    would mean nothing to it: another vocabulary, or the same one under another chat template."""
    from rlhf_hpc.models.tokenizer import build_tiny_tokenizer
    from rlhf_hpc.rewards.reward_model import needs_reencoding

    actor = build_tiny_tokenizer()
    assert not needs_reencoding(build_tiny_tokenizer(), actor)
    other_template = build_tiny_tokenizer()
    other_template.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert needs_reencoding(other_template, actor)
    require("the Qwen2 tokenizer", (SHARED / "assets" / "qwen2-tokenizer").is_dir(), "../shared/assets is missing")
    from transformers import AutoTokenizer

    assert needs_reencoding(AutoTokenizer.from_pretrained(SHARED / "assets" / "qwen2-tokenizer"), actor)


# ------------------------------------------------------------------------------ the demo with it
def write_model_scored_rows(path: Path, n: int) -> Path:
    """verl-format rows for a reward model: no rule exists for their data_source."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = ["hi", "bob", "ann", "sun", "red", "cat", "dog", "sky"]
    rows = [
        {
            "data_source": "hh_rlhf",
            "prompt": [{"role": "user", "content": f"greet {words[i % 8]} {i}"}],
            "reward_model": {"style": "model", "ground_truth": "none"},
            "extra_info": {"index": i},
        }
        for i in range(n)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.slow
def test_tiny_demo_trains_on_reward_model_scores(tmp_path):
    """tiny_klppo on 2 ranks with a tiny reward model, re-encoding through its chat template, on
    rows whose data_source has no rule: the training score is the reward model's (verl's naive
    reward manager), its metrics are logged every step, and validation on model-scored rows is
    skipped (verl validates with rules only)."""
    from rlhf_hpc.observability.tracking import read_metrics
    from tests.conftest import run_launch

    run = tmp_path / "run"
    train = write_model_scored_rows(tmp_path / "train.parquet", 32)
    val = write_model_scored_rows(tmp_path / "val.parquet", 4)
    out = run_launch(
        "recipe=tiny_klppo",
        f"trainer.default_local_dir={run}",
        "trainer.total_training_steps=3",
        f"data.train_files={train}",
        f"data.val_files={val}",
        "trainer.val_before_train=true",
        "trainer.save_freq=-1",
        "trainer.test_freq=3",
        "actor_rollout_ref.rollout.name=hf",
        *RM_ON,
        "reward_model.model.input_tokenizer=tiny://qwen2?vocab_size=64",
        "reward_model.model.fsdp_config.mixed_precision.param_dtype=float32",
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert "# OK   reward_model" in out.stdout  # the memory plan has its phase
    assert "validation skipped: data.val_files rows have reward_model.style=model" in out.stdout
    records = read_metrics(run)
    assert [r["training/global_step"] for r in records] == [1, 2, 3]
    for r in records:
        assert 0 < r["timing_s/reward_model"] <= r["timing_s/reward"]
        assert r["critic/score/mean"] == pytest.approx(r["reward_model/score/mean"], abs=1e-6)
        assert r["reward_model/score/max"] > r["reward_model/score/min"]
        assert not [k for k in r if k.startswith("val-core/")]
