"""The search tool (verl's SearchTool, Search-R1): BM25 over a passage corpus, verl's result text,
the same answers from a local index and from the retrieval service (python -m
rlhf_hpc.tools.retrieval_server, Search-R1's API, run here as a process), what fails answering the
model with an error; verl's search tool config mapped and checked at the dry run; Search-R1's reward."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from rlhf_hpc.config.errors import ConfigError
from rlhf_hpc.rewards import rule_score
from rlhf_hpc.tools.bm25 import Bm25Index, read_corpus
from rlhf_hpc.tools.search_tool import SearchTool
from rlhf_hpc.tools.tool_config import read_tool_config
from tests.conftest import REPO

CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany and its largest city.'},
    {"id": "2", "contents": '"Mount Everest"\nMount Everest is the highest mountain above sea level.'},
    {"id": "3", "contents": '"France"\nFrance is a country in Western Europe; its capital is Paris.'},
]
# verl b178a3c's examples/sglang_multiturn/config/tool_config/search_tool_config.yaml
SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web for relevant information based on the given query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "item": {"type": "string"},
                    "description": (
                        "A list of fully-formed semantic queries. The tool will return search results for each query."
                    ),
                }
            },
            "required": ["query_list"],
        },
    },
}
VERL_CONFIG = {
    "tools": [
        {
            "class_name": "verl.tools.search_tool.SearchTool",
            "config": {
                "retrieval_service_url": "http://127.0.0.1:8000/retrieve",
                "num_workers": 120,
                "rate_limit": 120,
                "timeout": 30,
                "type": "native",
            },
            "tool_schema": SCHEMA,
        }
    ]
}


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(d) for d in CORPUS) + "\n")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bm25_ranks_the_passages_that_hold_the_query():
    index = Bm25Index(CORPUS)
    assert [i for i, _ in index.search("highest mountain", 2)] == [2]  # (no other passage holds a term)
    best = [i for i, _ in index.search("capital of Germany", 4)]
    assert best[0] == 1 and set(best) == {0, 1, 3}
    assert index.search("capital of France", 1)[0][0] in (0, 3)
    assert index.search("zebra", 3) == []


@pytest.mark.slow
def test_a_local_index_and_the_retrieval_service_answer_alike_in_verls_text(corpus, tmp_path):
    local = SearchTool({"local_index": str(corpus), "topk": 2}, SCHEMA)
    out = local.execute({"query_list": ["highest mountain", "capital of Germany"]}, {})
    text = json.loads(out.text)["result"]
    assert out.status == "ok" and text.startswith(
        'Doc 1 (Title: "Mount Everest")\nMount Everest is the highest mountain above sea level.\n---\n'
        'Doc 1 (Title: "Berlin")\nBerlin is the capital of Germany and its largest city.\n\nDoc 2 (Title: '
    )
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "rlhf_hpc.tools.retrieval_server", "--corpus", str(corpus), "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # the tool retries a service that is still starting, within its timeout
        remote = SearchTool(
            {"retrieval_service_url": f"http://127.0.0.1:{port}/retrieve", "topk": 2, "timeout": 30}, SCHEMA
        )
        assert remote.execute({"query_list": ["highest mountain", "capital of Germany"]}, {}) == out
        assert "serving 4 passages" in server.stdout.readline()
    finally:
        server.terminate()
        server.wait(timeout=30)
    # nothing listening: an error text the model reads, counted as the tool's error
    t0 = time.monotonic()
    gone = SearchTool({"retrieval_service_url": f"http://127.0.0.1:{port}/retrieve", "timeout": 2}, SCHEMA)
    failed = gone.execute({"query_list": ["x"]}, {})
    assert failed.status == "error" and json.loads(failed.text)["result"].startswith("Search error: URLError")
    assert time.monotonic() - t0 < 10
    bad = local.execute({"query_list": "not a list"}, {})
    assert bad.status == "error" and "'query_list' is missing, empty, or not a list" in bad.text
    with pytest.raises(ValueError, match="line 2: not JSON"):
        (tmp_path / "broken.jsonl").write_text(json.dumps(CORPUS[0]) + "\n{broken\n")
        read_corpus(str(tmp_path / "broken.jsonl"))


def test_verls_search_tool_config_maps_here_and_is_checked(corpus, tmp_path):
    path = tmp_path / "search_tool_config.yaml"
    path.write_text(json.dumps(VERL_CONFIG))
    [entry] = read_tool_config(str(path))
    assert (entry.name, entry.cls, entry.sandbox) == ("search", SearchTool, False)
    for config, message in (
        ({"type": "native"}, "needs one of config.retrieval_service_url"),
        ({"local_index": str(tmp_path / "none.jsonl")}, "none.jsonl: no such file"),
    ):
        path.write_text(json.dumps({"tools": [{**VERL_CONFIG["tools"][0], "config": config}]}))
        with pytest.raises(ConfigError, match=r"search_tool_config.yaml, tools\[0\]: .*" + message):
            read_tool_config(str(path))


def test_search_r1s_reward_is_the_exact_match_of_the_last_answer():
    truth = {"target": ["Paris", "City of Paris"]}
    assert rule_score("searchR1_nq", "<think>...</think><answer> paris. </answer>", truth, {}) == 1.0
    assert rule_score("searchR1_nq", "<answer>Berlin</answer> no, <answer>The City of Paris</answer>", truth, {}) == 1.0
    assert rule_score("searchR1_hotpotqa", "<answer>Paris</answer> then <answer>Lyon</answer>", truth, {}) == 0.0
    assert rule_score("searchR1_nq", "Paris", truth, {}) == 0.0
    assert rule_score("searchR1_nq", "<answer>Paris</answer>" * 11, truth, {}) == 0.25


# verl b178a3c's examples/sglang_multiturn/search_r1_like/run_qwen2.5-3b_instruct_search_multiturn.sh
# with its config file's keys (search_multiturn_grpo.yaml) on the command line, `$@` left out
VERL_SEARCH = """
    data.max_prompt_length=1024 data.max_response_length=1024 data.train_batch_size=256 data.return_raw_chat=True
    data.shuffle=False actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.multi_turn.enable=True
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2 actor_rollout_ref.rollout.multi_turn.format=qwen
    algorithm.adv_estimator=grpo data.train_batch_size=512 data.val_batch_size=256 data.max_prompt_length=4096
    data.max_response_length=3000 data.filter_overlong_prompts=True data.truncation='error' data.return_raw_chat=True
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285 actor_rollout_ref.model.use_remove_padding=True
    actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
    actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
    actor_rollout_ref.actor.kl_loss_type=low_var_kl actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.model.enable_gradient_checkpointing=True actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False actor_rollout_ref.rollout.max_model_len=15000
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.rollout.tensor_model_parallel_size=1
    actor_rollout_ref.rollout.name=sglang actor_rollout_ref.rollout.gpu_memory_utilization=0.5
    actor_rollout_ref.rollout.n=5 actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 actor_rollout_ref.ref.fsdp_config.param_offload=True
    algorithm.use_kl_in_reward=False trainer.critic_warmup=0 trainer.val_before_train=False
    trainer.logger='["console","wandb"]' trainer.project_name='search_r1_like_async_rl'
    trainer.experiment_name='qwen2.5-3b-instruct_function_rm-search-async-sgl-multi-w-searchtool-verify-n16'
    trainer.n_gpus_per_node=8 trainer.nnodes=1 trainer.save_freq=100 trainer.test_freq=50
    data.train_files="$HOME/data/searchR1_processed_direct/train.parquet"
    data.val_files="$HOME/data/searchR1_processed_direct/test.parquet"
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HOME/search_tool_config.yaml" trainer.total_epochs=1
"""


@pytest.mark.slow
def test_verls_search_command_line_dry_runs_on_prepared_search_r1_rows(tmp_path, capsys):
    import shlex
    import textwrap

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlhf_hpc.cli import main as cli_main

    src = tmp_path / "nq_hotpotqa_train"  # Search-R1's records, as the hub holds them (a batch of 512)
    src.mkdir()
    for split in ("train", "test"):
        pq.write_table(
            pa.Table.from_pylist(
                [
                    {
                        "id": f"{split}_{i}",
                        "question": q,
                        "golden_answers": [a],
                        "data_source": source,
                        "ability": "fact-reasoning",
                        "reward_model": {"style": "rule", "ground_truth": {"target": [a]}},
                        "metadata": None,
                    }
                    for i, (q, a, source) in enumerate(
                        [("capital of france?", "Paris", "nq"), ("highest mountain?", "Mount Everest", "hotpotqa")]
                        * 256
                    )
                ]
            ),
            src / f"{split}.parquet",
        )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlhf_hpc.data.prepare",
            "search_r1",
            "--src",
            str(src),
            "--out",
            str(tmp_path / "data" / "searchR1_processed_direct"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    [row, *_] = pq.read_table(tmp_path / "data/searchR1_processed_direct/train.parquet").to_pylist()
    assert row["data_source"] == "searchR1_nq" and row["reward_model"]["ground_truth"] == {"target": ["Paris"]}
    assert row["prompt"][1]["content"].endswith("<answer> Beijing </answer>. Question: capital of france?")
    assert row["extra_info"]["tools_kwargs"]["search"]["create_kwargs"]["question"] == "capital of france?"
    (tmp_path / "search_tool_config.yaml").write_text((REPO / "recipes/tools/search_tool_config.yaml").read_text())
    args = shlex.split(textwrap.dedent(VERL_SEARCH).replace("$HOME", str(tmp_path))) + ["cluster=local", "--dry-run"]
    capsys.readouterr()
    # as written: SGLang and the config file's format name are refused by name (verl's own agent loop has no
    # "qwen" parser either: hermes is Qwen2.5's)
    assert cli_main(args) == 2
    err = capsys.readouterr().err
    assert "unknown rollout engine 'sglang'" in err and "unknown tool-call format 'qwen'; registered: hermes" in err, (
        err
    )
    args = [a.replace("name=sglang", "name=vllm").replace("format=qwen", "format=hermes") for a in args]
    assert cli_main(args) == 0, capsys.readouterr().err
