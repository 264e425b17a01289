"""Issue #40 (4.): the models a run names, checked at the dry run, each refusal with exit 2 and its
key, no traceback: the model directory (weights there and of the shapes its config.json makes, a
tied head needing none), the tokenizer (there, not empty, a chat template that renders a prompt,
no more tokens than the embedding has rows), LoRA (target modules that exist, an adapter whose
rank, alpha and shapes are the config's and the model's; LoRA keys without LoRA). Real files in
tmp_path: a tiny model saved by transformers, the built-in tokenizer saved beside it, adapters
saved by PEFT; the CLI runs in this process (``rlhf_hpc.cli.main``)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhf_hpc.cli import main as launch
from rlhf_hpc.config.schema import ModelConfig
from rlhf_hpc.models.hf import build_causal_lm
from rlhf_hpc.models.lora import apply_lora
from rlhf_hpc.models.tokenizer import build_tiny_tokenizer, tokenizer_problems
from tests.conftest import SHARED

TIED = "tiny://qwen2?vocab_size=64&tie_word_embeddings=true"  # no lm_head tensor in its weights
KEY = "actor_rollout_ref.model"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Model directories and adapters, each with one thing wrong (``good``: nothing)."""
    root = tmp_path_factory.mktemp("models")
    model, tok = build_causal_lm(TIED, torch.float32), build_tiny_tokenizer()
    model.save_pretrained(root / "good")
    tok.save_pretrained(root / "good")
    shutil.copytree(root / "good", root / "no_weights")
    (root / "no_weights" / "model.safetensors").unlink()
    shutil.copytree(root / "good", root / "missing_shard")
    (root / "missing_shard" / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "model.norm.weight": "model.safetensors",
                }
            }
        )
    )
    shutil.copytree(root / "good", root / "other_shape")
    config = json.loads((root / "other_shape" / "config.json").read_text())
    (root / "other_shape" / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    model.save_pretrained(root / "no_tokenizer")
    tok.chat_template = None
    model.save_pretrained(root / "no_template")
    tok.save_pretrained(root / "no_template")
    for name, path in (("adapter", TIED), ("adapter_of_another_model", "tiny://qwen2?vocab_size=64&hidden_size=64")):
        peft = apply_lora(
            build_causal_lm(path, torch.float32), ModelConfig(path=path, lora_rank=4, lora_alpha=8), seed=0
        )
        peft.save_pretrained(root / name)
    return root


@pytest.fixture(autouse=True)
def one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def dry_run(capsys, *overrides: str) -> tuple[int, str]:
    """(exit code, stderr) of ``launch.py recipe=tiny_klppo OVERRIDES --dry-run``."""
    capsys.readouterr()
    rc = launch(["recipe=tiny_klppo", *overrides, "--dry-run"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_a_sound_model_directory_and_adapter_pass(made, capsys):
    rc, err = dry_run(
        capsys,
        f"{KEY}.path={made / 'good'}",
        f"{KEY}.lora_adapter_path={made / 'adapter'}",
        f"{KEY}.lora_rank=4",
        f"{KEY}.lora_alpha=8",
    )
    assert rc == 0, err


def test_a_directory_with_config_json_only_is_planned_and_refused_at_the_run(made, capsys, tmp_path):
    """What a user has before the download: the dry run and ``launch.py plan`` plan it from its
    config.json, saying so in one line; the run itself refuses it, naming what is missing."""
    only = tmp_path / "config_only"
    only.mkdir()
    shutil.copy(made / "good" / "config.json", only / "config.json")
    for d, tokenizer in ((only, ", no tokenizer"), (made / "no_weights", "")):
        rc, err = dry_run(capsys, f"{KEY}.path={d}", "data.tokenizer=null")
        assert rc == 0, err
        assert (
            f"warning: {KEY}.path={d}: config.json only here (no weights{tokenizer}): planned from its config; "
            f"the run needs the weights where it runs"
        ) in err
        capsys.readouterr()
        assert launch(["plan", "recipe=tiny_klppo", f"{KEY}.path={d}", "data.tokenizer=null"]) == 0
        out = capsys.readouterr().out
        assert "| as written | " in out and "does not fit" not in out, out
        capsys.readouterr()
        rc = launch(
            [
                "recipe=tiny_klppo",
                f"{KEY}.path={d}",
                "data.tokenizer=null",
                f"trainer.default_local_dir={tmp_path / 'run'}",
            ]
        )
        err = capsys.readouterr().err
        assert rc == 2 and f"{KEY}.path={d}: no weights in {d} (config.json is there" in err, err
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "directory,says",
    [
        (
            "missing_shard",
            "model.safetensors.index.json lists 2 shards and model-00001-of-00002.safetensors is missing",
        ),
        (
            "other_shape",
            "weights of another shape than config.json's: model.layers.0.mlp.gate_proj.weight is "
            "[256, 128], the config makes [512, 128];",
        ),
        (
            "no_tokenizer",
            "the tokenizer is empty: 1 token(s), 'what is 12 + 30? answer with the number.' encodes to 0; "
            "{d} has none of a tokenizer's files",
        ),
        (
            "no_template",
            "the tokenizer has no chat template, and every prompt is chat messages: set "
            "actor_rollout_ref.model.custom_chat_template",
        ),
    ],
)
def test_a_bad_model_directory_is_refused_naming_the_key(made, capsys, directory, says):
    d = made / directory
    rc, err = dry_run(capsys, f"{KEY}.path={d}")
    assert rc == 2 and f"{KEY}.path={d}: {says.format(d=d)}" in err, err


def test_a_custom_chat_template_does_not_hide_a_missing_tokenizer_and_is_itself_checked(made, capsys):
    """The issue's case: no tokenizer files and a custom template (every prompt would become 0
    tokens and generate would die with an IndexError on every rank); a template that renders
    nothing is named by its own key."""
    d = made / "no_tokenizer"
    rc, err = dry_run(capsys, f"{KEY}.path={d}", f"{KEY}.custom_chat_template='{{{{ messages[0].content }}}}'")
    assert rc == 2 and f"{KEY}.path={d}: the tokenizer is empty: 1 token(s)" in err, err
    rc, err = dry_run(capsys, f"{KEY}.custom_chat_template='{{% for m in messages %}}{{% endfor %}}'")
    assert (
        rc == 2
        and (f"{KEY}.custom_chat_template: the tokenizer's chat template renders a one-message prompt to 0 tokens")
        in err
    ), err


def test_a_tokenizer_larger_than_the_embedding_is_refused(capsys):
    rc, err = dry_run(capsys, f"{KEY}.path=tiny://qwen2?vocab_size=32")
    assert (
        rc == 2
        and (
            f"{KEY}.path=tiny://chars: the tokenizer has 64 tokens, more than the model's 32 embedding "
            f"rows (vocab_size)"
        )
        in err
    ), err


def test_a_real_tokenizer_passes_with_its_own_chat_template():
    tokenizer = SHARED / "assets" / "qwen2-tokenizer"
    if not tokenizer.is_dir():
        pytest.skip(f"{tokenizer} is missing")
    assert tokenizer_problems(str(tokenizer), vocab_size=151936) == []
    assert tokenizer_problems(str(tokenizer), vocab_size=151000)[0].startswith("the tokenizer has 151646 tokens")


@pytest.mark.parametrize(
    "overrides,says",
    [
        # PEFT's NoMatchingPeftModuleError from the memory plan before; one unknown name beside a known
        # one PEFT would have ignored
        (
            [f"{KEY}.lora_rank=8", f"{KEY}.target_modules=[nonexistent_module]"],
            f"{KEY}.target_modules: nonexistent_module matches no module of Qwen2ForCausalLM "
            f"(tiny://qwen2?vocab_size=64); "
            f"its linear layers: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj",
        ),
        (
            [f"{KEY}.lora_rank=8", f"{KEY}.target_modules=[q_proj,v_prj]"],
            f"{KEY}.target_modules: v_prj matches no module",
        ),
        (
            ["critic.model.lora_rank=4", "critic.model.target_modules=[lm_head]"],
            "critic.model.target_modules: lm_head matches no module of Qwen2Model",
        ),  # the critic's backbone has no head
        # keys accepted and ignored before
        (
            [f"{KEY}.lora_alpha=32"],
            f"{KEY}.lora_alpha=32 has no effect: LoRA is off ({KEY}.lora_rank=0, no "
            f"lora_adapter_path); set {KEY}.lora_rank > 0, or remove the key",
        ),
        (["critic.model.target_modules=[q_proj]"], "critic.model.target_modules=['q_proj'] has no effect: LoRA is off"),
    ],
)
def test_lora_keys_against_the_model_are_checked_at_the_dry_run(capsys, overrides, says):
    rc, err = dry_run(capsys, *overrides)
    assert rc == 2 and says in err, err


@pytest.mark.parametrize(
    "overrides,says",
    [
        (
            [f"{KEY}.lora_rank=8"],
            f"{KEY}.lora_rank=8, but the adapter at {KEY}.lora_adapter_path={{a}} has rank 4, which "
            f"is what trains; set {KEY}.lora_rank=4, or 0 to take the adapter's",
        ),
        (
            [f"{KEY}.lora_alpha=32"],
            f"{KEY}.lora_alpha=32, but the adapter at {KEY}.lora_adapter_path={{a}} has "
            f"lora_alpha=8, which is what trains",
        ),
        ([f"{KEY}.target_modules=[q_proj]"], f"{KEY}.target_modules=['q_proj'], but the adapter"),
        (
            [f"{KEY}.lora_adapter_path={{other}}"],
            f"{KEY}.lora_adapter_path={{other}}: its tensors have other shapes than "
            f"this model's layers make (base_model.model.model.layers.0.mlp.down_proj"
            f".lora_B.weight is [64, 4], this model makes [128, 4];",
        ),
    ],
)
def test_an_adapter_that_is_not_the_configs_or_the_models_is_refused(made, capsys, overrides, says):
    a, other = made / "adapter", made / "adapter_of_another_model"
    rc, err = dry_run(
        capsys, f"{KEY}.path={TIED}", f"{KEY}.lora_adapter_path={a}", *(o.format(other=other) for o in overrides)
    )
    assert rc == 2 and says.format(a=a, other=other) in err, err
