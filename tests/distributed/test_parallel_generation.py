"""Tensor and expert parallel end to end on the CPU with gloo: worker ranks are real processes.

Greedy token ids of tp=2, ep=2 and tp=2 x ep=2 (world 4) equal one rank's and transformers', for a
dense family (KV heads that divide, and a single KV head replicated over the TP ranks) and both
MoE families (8 experts, and 5 that split unevenly over 2 EP ranks), with prompts of several
lengths under a 16-token step budget (chunked prefill mixed with decodes); seeded sampling equals
one rank's. Then the ways to start ranks (`met generate`, `met serve`, torchrun), what happens
when a rank dies, and the refusals that come before any process starts.

Each configuration starts its own workers (a few seconds each on two cores), so each builds one
engine and asks it everything at once.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from checkpoints import load_reference, make_checkpoint, reference_greedy
from metrale import LLM, SamplingParams
from metrale.distributed.launch import WorkerDiedError
from metrale.distributed.topology import TopologyError
from parallel_cases import PROMPT_LENGTHS, build_checkpoint, free_port, make_prompts

NEW_TOKENS = 8
STEP_BUDGET = 16  # tokens per step: the longer prompts prefill in chunks beside the others' decodes
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [
    ("qwen3", dict(tp_size=2)),
    ("llama_kv1", dict(tp_size=2)),
    ("llama_kv1", dict(ep_size=2)),
    ("llama_kv1", dict(tp_size=2, ep_size=2, world_size=4)),
    ("qwen3_moe", dict(tp_size=2)),
    ("qwen3_moe", dict(ep_size=2)),
    ("qwen3_moe", dict(tp_size=2, ep_size=2, world_size=4)),
    ("qwen3_moe", dict(tp_size=2, ep_size=2, moe_expert_layout="tp")),
    ("minimax_m2_uneven", dict(tp_size=2)),
    ("minimax_m2_uneven", dict(ep_size=2)),
    ("minimax_m2_uneven", dict(tp_size=2, ep_size=2, world_size=4)),
    ("minimax_m2_uneven", dict(tp_size=2, ep_size=2)),
    ("qwen3_next", dict(tp_size=2)),
    ("qwen3_next", dict(ep_size=2)),
    ("qwen3_5", dict(tp_size=2)),
]


def _case_id(case) -> str:
    name, sizes = case
    return name + "-" + "-".join(f"{k.replace('_size', '')}{v}" for k, v in sizes.items())


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=NEW_TOKENS, ignore_eos=True)
          for i in range(len(PROMPT_LENGTHS))]


def run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy and seeded-sampling token ids of every prompt, each batch in one go."""
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    seeded = [o.outputs[0].token_ids for o in llm.generate(prompts, SEEDED, use_tqdm=False)]
    return greedy, seeded


def engine(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_num_batched_tokens=STEP_BUDGET, **kwargs)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = build_checkpoint(name, str(tmp_path_factory.mktemp(f"ckpt_{name}")))
        return cache[name]

    return get


@pytest.fixture(scope="module")
def references(checkpoint):
    """name -> (transformers' greedy ids, one rank's greedy ids, one rank's seeded ids)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            path = checkpoint(name)
            model = load_reference(path)
            hf = [reference_greedy(model, p, NEW_TOKENS) for p in make_prompts()]
            greedy, seeded = run(engine(path))
            cache[name] = hf, greedy, seeded
        return cache[name]

    return get


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_tokens_match_one_rank_and_transformers(case, checkpoint, references):
    name, sizes = case
    hf, single_greedy, single_seeded = references(name)
    assert single_greedy == hf
    llm = engine(checkpoint(name), master_port=free_port(), **sizes)
    try:
        assert llm.llm_engine.executor.world_size == (4 if sizes.get("world_size") == 4 else 2)
        assert not llm.llm_engine.async_scheduling  # the CPU's default
        greedy, seeded = run(llm)
    finally:
        llm.llm_engine.shutdown()
    assert greedy == hf
    assert seeded == single_seeded


@pytest.mark.parametrize("case", [("qwen3", dict(tp_size=2)), ("qwen3_moe", dict(tp_size=2, ep_size=2, world_size=4)),
                                  ("qwen3_next", dict(tp_size=2))],
                         ids=_case_id)
def test_asynchronous_scheduling_over_ranks(case, checkpoint, references):
    """Every rank launches step N+1 before reading step N's tokens, taking them from its own
    device; the workers check theirs against rank 0's. Same tokens as one rank and transformers."""
    name, sizes = case
    hf, _, single_seeded = references(name)
    llm = engine(checkpoint(name), master_port=free_port(), async_scheduling=True, **sizes)
    try:
        assert llm.llm_engine.async_scheduling
        greedy, seeded = run(llm)
    finally:
        llm.llm_engine.shutdown()
    assert greedy == hf
    assert seeded == single_seeded


def test_asynchronous_ranks_with_penalties_stops_and_n(checkpoint):
    """Steps with penalties make rank 0 read the step in flight first ("read_first"); stop
    tokens end requests with a step in flight; n=2 forks seeded streams. Same outputs as one
    rank with asynchronous scheduling."""
    path = checkpoint("qwen3")
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    one_rank = engine(path, async_scheduling=True).generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    stop_at = [o.outputs[0].token_ids[3] for o in one_rank]  # a token each greedy run produces
    params = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at[1]]),
              SamplingParams(temperature=0.8, max_tokens=12, n=2, seed=7, frequency_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at[3]], ignore_eos=True)]

    def outputs(llm):
        return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in llm.generate(prompts, params)]

    expected = outputs(engine(path, async_scheduling=True))
    llm = engine(path, tp_size=2, master_port=free_port(), async_scheduling=True)
    try:
        assert outputs(llm) == expected
    finally:
        llm.llm_engine.shutdown()
    assert any(reason == "stop" for out in expected for _, reason in out)


# Shipped configs shrunk by --hf-overrides to a few layers of small width.
SMALL_QWEN3 = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 32}
SMALL_QWEN3_MOE = dict(SMALL_QWEN3, moe_intermediate_size=64, num_experts=8)


@pytest.mark.parametrize("name, overrides, sizes", [
    ("Qwen3-8B", SMALL_QWEN3, dict(tp_size=2)),
    ("Qwen3-30B-A3B", SMALL_QWEN3_MOE, dict(ep_size=2)),
], ids=["qwen3-tp2", "qwen3_moe-ep2"])
def test_dummy_weights_split_over_ranks_compute_what_one_rank_computes(name, overrides, sizes):
    """--load-format dummy draws each full checkpoint tensor from a generator seeded by its name,
    and each rank loads its shard of it: a split model is the one-rank model, cut."""
    def dummy(**kw) -> LLM:
        return engine(name, load_format="dummy", hf_overrides=overrides, skip_tokenizer_init=True,
                      max_model_len=128, **kw)

    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    single = [o.outputs[0].token_ids for o in dummy().generate(prompts, GREEDY, use_tqdm=False)]
    llm = dummy(master_port=free_port(), **sizes)
    try:
        split = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
    assert split == single
    assert len({tuple(t) for t in single}) > 1  # the prompts lead to different tokens: a real check


# -- refusals before any process starts ----------------------------------------------------------


def _assert_nothing_started():
    assert not torch.distributed.is_initialized()


def test_heads_that_do_not_divide_are_refused_with_the_model_and_sizes(tmp_path):
    path = make_checkpoint(str(tmp_path / "qwen3_3heads"), "qwen3", num_attention_heads=3, num_key_value_heads=1)
    with pytest.raises(TopologyError, match=r"^Qwen3ForCausalLM: 3 attention heads cannot be split evenly over "
                                            r"tp_size=2, and with fewer KV heads \(1\) than ranks .* "
                                            r"tensor-parallel sizes that work: 1, 3$"):
        engine(path, tp_size=2, master_port=free_port())
    _assert_nothing_started()


def test_too_few_experts_for_the_ep_ranks_is_refused(checkpoint):
    with pytest.raises(TopologyError) as e:
        engine(checkpoint("qwen3_moe"), ep_size=16, master_port=free_port())
    assert "Qwen3MoeForCausalLM cannot be split over tp_size=1, ep_size=16 (--moe-expert-layout ep)" in str(e.value)
    assert "8 experts cannot be split over 16 expert-parallel ranks" in str(e.value)
    _assert_nothing_started()


def test_expert_layout_tp_on_a_mesh_and_bad_worlds_are_refused(checkpoint):
    with pytest.raises(TopologyError, match="needs ep_size 1 or tp_size = ep_size = world_size; got tp_size=2, "
                                            "ep_size=2, world_size=4"):
        engine(checkpoint("qwen3_moe"), tp_size=2, ep_size=2, world_size=4, moe_expert_layout="tp")
    with pytest.raises(TopologyError, match=r"world_size=3, but tp_size=2 x ep_size=1 = 2"):
        engine(checkpoint("qwen3"), tp_size=2, world_size=3)
    _assert_nothing_started()


# -- ranks that die --------------------------------------------------------------------------------


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_dead_worker_is_reported_and_one_engine_at_a_time(checkpoint, references, async_scheduling):
    path, expected = checkpoint("qwen3"), references("qwen3")[0][:1]
    with socket.socket() as busy:  # on one host a busy rendezvous port is swapped for a free one
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        llm = engine(path, tp_size=2, master_port=busy.getsockname()[1], async_scheduling=async_scheduling)
    try:
        prompts = [{"prompt_token_ids": p} for p in make_prompts()]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts[:1], GREEDY)] == expected
        with pytest.raises(RuntimeError, match="still holds the process groups of a multi-rank engine"):
            engine(path, tp_size=2, master_port=free_port())
        with pytest.raises(RuntimeError, match="still holds the process groups"):
            engine(path)  # a single rank would build its layers sharded
        worker = llm.llm_engine.executor.parallel.workers[0]
        worker.process.kill()
        worker.process.wait()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(pid \d+\) exited with code -9"):
            llm.generate(prompts, GREEDY)
        with pytest.raises(WorkerDiedError):  # and stays dead
            llm.generate(prompts, GREEDY)
    finally:
        llm.llm_engine.shutdown()
    assert not torch.distributed.is_initialized()
    assert [o.outputs[0].token_ids for o in engine(path).generate(prompts[:1], GREEDY)] == expected


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _worker_pids(log: str) -> list[int]:
    match = re.search(r"started \d+ worker rank\(s\): pids ([\d, ]+)", log)
    assert match, log
    return [int(p) for p in match.group(1).split(", ")]


def _env() -> dict:
    return dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH")) if p))


def test_workers_end_when_rank_zero_crashes(checkpoint):
    script = ("import os, sys; from metrale import LLM; "
              f"llm = LLM({checkpoint('qwen3')!r}, device='cpu', tp_size=2, master_port={free_port()}); "
              "print('PIDS', *[w.process.pid for w in llm.llm_engine.executor.parallel.workers], flush=True); "
              "os._exit(3)")  # no atexit, no stop message: as if killed
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 3, done.stderr
    pids = [int(p) for p in re.search(r"PIDS ([\d ]+)", done.stdout).group(1).split()]
    assert all(_wait_gone(pid) for pid in pids)


# -- the ways to start ranks -----------------------------------------------------------------------


def _met(*argv: str) -> list[str]:
    return [sys.executable, "-m", "metrale.entrypoints.cli", *argv]


def _single_rank_text(path: str, prompt: str) -> str:
    out = engine(path).generate([prompt], SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return out[0].outputs[0].text


def test_met_generate_with_tp_size(checkpoint):
    path, prompt = checkpoint("qwen3"), "The quick brown fox"
    done = subprocess.run(_met("generate", "--model", path, "--prompt", prompt, "--max-tokens", str(NEW_TOKENS),
                               "--device", "cpu", "--tp-size", "2", "--master-port", str(free_port())),
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == _single_rank_text(path, prompt)
    assert all(_wait_gone(pid) for pid in _worker_pids(done.stderr))
    assert "stopped after" in done.stderr  # the worker left its loop on the stop message


@pytest.mark.parametrize("store", ["agent", "met"])
def test_torchrun_launches_every_rank(checkpoint, store):
    """torchrun's agent hosts a TCPStore (its default: kept, and said to be torchrun's), or, with
    the store's sharing turned off, rank 0 hosts met's, and the ranks authenticate with
    MET_RANK_SECRET from torchrun's environment."""
    path, prompt = checkpoint("qwen3"), "Hello, world!"
    if store == "agent":
        launcher, env = ["--master-port", str(free_port())], _env()
    else:
        launcher = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
        env = dict(_env(), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", MET_RANK_SECRET="0123456789abcdef" * 4)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *launcher,
                           "-m", "metrale.entrypoints.worker",
                           "generate", "--model", path, "--prompt", prompt, "--max-tokens", str(NEW_TOKENS),
                           "--device", "cpu", "--tp-size", "2"],
                          capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.rstrip("\n") == _single_rank_text(path, prompt)
    assert "worker rank(s): pids" not in done.stderr  # torchrun started the ranks; rank 0 spawned none
    if store == "agent":
        assert "torchrun's own TCP store" in done.stderr
    else:
        assert re.search(r"rank rendezvous listening on (127\.0\.0\.1|\[::1\]):\d+", done.stderr), done.stderr


def test_met_serve_with_tp_size(checkpoint, references, tmp_path):
    import httpx

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(_met("serve", "--model", checkpoint("qwen3"), "--device", "cpu", "--port", str(port),
                                       "--tp-size", "2", "--master-port", str(free_port()),
                                       "--max-num-batched-tokens", str(STEP_BUDGET)),
                                  stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "prompt": make_prompts(), "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}).json()
        assert [c["token_ids"] for c in sorted(reply["choices"], key=lambda c: c["index"])] == references("qwen3")[0]
        ranks = httpx.get(f"http://127.0.0.1:{port}/memory", timeout=10).json()["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["weights_bytes"] > 0 and r["kv_cache_bytes"] > 0 and r["host_rss_bytes"] > 0 for r in ranks)
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0, log_path.read_text()
    finally:
        if server.poll() is None:
            server.kill()
    log = log_path.read_text()
    assert all(_wait_gone(pid) for pid in _worker_pids(log)), log
    # The fixed startup phases, the same numbers and names on both ranks (worker under its rank).
    phases: dict[str, list[tuple[int, str]]] = {}
    for match in re.finditer(r"(?:\[rank (\d+)\] )?metrale\.startup\.phases: \[(\d)\] (.+?) +\d+\.\d+s", log):
        phases.setdefault(match.group(1) or "0", []).append((int(match.group(2)), match.group(3)))
    names = ["imports", "model resolve", "configure", "backend", "topology", "weights", "kv cache", "kernel audit",
             "ready"]
    assert phases["0"] == list(enumerate(names)), phases
    assert phases["1"] == list(enumerate(names))[1:8], phases


def _host_address() -> str | None:
    """A non-loopback IPv4 address of this machine: rank 0 then spawns nobody, as on several hosts."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return next((a for a in out if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", a) and not a.startswith("127.")), None)


def test_ranks_started_by_hand_as_on_several_hosts(checkpoint, tmp_path):
    """Opted in with --allow-remote-ranks; rank 0 reads the secret from a file, rank 1 from
    MET_RANK_SECRET. Rank 0's rendezvous listens on that address only."""
    address = _host_address()
    if address is None:
        pytest.skip("no non-loopback address on this machine")
    path, prompt, port = checkpoint("qwen3"), "Hello, world!", str(free_port())
    secret = "0123456789abcdef" * 4
    secret_file = tmp_path / "rank-secret"
    secret_file.write_text(secret + "\n")
    secret_file.chmod(0o600)
    common = ["--model", path, "--prompt", prompt, "--max-tokens", str(NEW_TOKENS), "--device", "cpu",
              "--tp-size", "2", "--world-size", "2", "--master-addr", address, "--master-port", port,
              "--allow-remote-ranks"]
    worker = subprocess.Popen(_met("generate", *common, "--rank", "1"),  # a non-zero rank: no generate, steps
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(_env(), MET_RANK_SECRET=secret))
    try:
        done = subprocess.run(_met("generate", *common, "--rank", "0", "--rank-secret-file", str(secret_file)),
                              capture_output=True, text=True, env=_env(), timeout=120)
        worker_log, _ = worker.communicate(timeout=60)
    finally:
        if worker.poll() is None:
            worker.kill()
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip("\n") == _single_rank_text(path, prompt)
    assert "worker rank(s): pids" not in done.stderr  # rank 0 started nobody
    assert f"rank rendezvous listening on {address}:{port}" in done.stderr
    assert worker.returncode == 0 and "rank 1: stopped after" in worker_log, worker_log
