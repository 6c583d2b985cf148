"""Topology rules and their messages, rank placement, group partitions, the MoE reduce group and
layout per topology, the torchrun environment, the step message encoding, and the KV block
agreement: all without starting a process."""

import logging
from types import SimpleNamespace

import msgpack
import pytest

from metrale.distributed import parallel_state
from metrale.distributed.launch import is_loopback, topology_from_args, torchrun_env
from metrale.distributed.moe_layout import moe_layout, moe_reduce_group
from metrale.distributed.topology import (Topology, TopologyError, check_attention_heads, check_expert_layout,
                                          parallel_sizes, resolve_topology)

# -- resolve_topology --------------------------------------------------------------------------


def test_single_rank():
    assert resolve_topology(1, 1, 1, 0) == Topology(1, 1, 1, 0, 0, 0)


def test_world_without_sizes_makes_every_rank_an_ep_rank():
    topologies = [resolve_topology(1, 1, 4, r) for r in range(4)]
    assert [(t.tp_size, t.ep_size, t.world_size) for t in topologies] == [(1, 4, 4)] * 4
    assert [(t.tp_rank, t.ep_rank) for t in topologies] == [(0, 0), (0, 1), (0, 2), (0, 3)]


def test_orthogonal_mesh_places_tp_ranks_consecutively():
    ranks = [resolve_topology(2, 3, 6, r) for r in range(6)]
    assert [(t.tp_rank, t.ep_rank) for t in ranks] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert not ranks[0].overlapping
    assert ranks[0].tp_group_ranks() == [[0, 1], [2, 3], [4, 5]]
    assert ranks[0].ep_group_ranks() == [[0, 2, 4], [1, 3, 5]]


def test_mesh_with_equal_tp_and_ep_needs_the_world_given():
    mesh = [resolve_topology(2, 2, 4, r) for r in range(4)]
    assert [(t.tp_rank, t.ep_rank) for t in mesh] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert not mesh[0].overlapping
    assert mesh[0].tp_group_ranks() == [[0, 1], [2, 3]] and mesh[0].ep_group_ranks() == [[0, 2], [1, 3]]


def test_overlapping_groups_share_every_rank():
    for world_arg in (1, 2):  # derived or given
        t = resolve_topology(2, 2, world_arg, 1)
        assert (t.world_size, t.tp_rank, t.ep_rank) == (2, 1, 1)
        assert t.overlapping
        assert t.tp_group_ranks() == t.ep_group_ranks() == [[0, 1]]


@pytest.mark.parametrize("tp, ep, world", [(2, 1, 2), (1, 2, 2), (4, 2, 8), (2, 4, 8), (3, 3, 3), (1, 5, 5)])
def test_derived_world_is_logged(tp, ep, world, caplog):
    with caplog.at_level(logging.INFO, logger="metrale.distributed.topology"):
        t = resolve_topology(tp, ep, 1, 0)
    assert t.world_size == world
    message = caplog.records[-1].getMessage()
    assert f"world size {world} derived from --tp-size {tp} --ep-size {ep}" in message
    assert "--world-size" in message


def test_given_world_is_not_logged(caplog):
    with caplog.at_level(logging.INFO, logger="metrale.distributed.topology"):
        resolve_topology(2, 1, 2, 0)
        resolve_topology(1, 1, 1, 0)
    assert not caplog.records


@pytest.mark.parametrize("tp, ep, world", [(2, 1, 3), (2, 2, 3), (2, 2, 8), (4, 1, 2), (3, 2, 5)])
def test_any_other_world_is_refused_with_the_sizes(tp, ep, world):
    with pytest.raises(TopologyError) as e:
        resolve_topology(tp, ep, world, 0)
    message = str(e.value)
    assert f"world_size={world}" in message and f"tp_size={tp} x ep_size={ep} = {tp * ep}" in message
    assert "orthogonal mesh" in message and "overlapping groups" in message


def test_rank_outside_the_world_is_refused():
    with pytest.raises(TopologyError, match="rank 4 is outside a world of 4 ranks"):
        resolve_topology(2, 2, 4, 4)


def test_parallel_sizes_as_the_rules_read_them():
    assert parallel_sizes(1, 1, 6) == (1, 6, 6)
    assert parallel_sizes(0, 0, 1) == (1, 1, 1)
    assert parallel_sizes(2, 2, 1) == (2, 2, 2)
    assert parallel_sizes(2, 3, 1) == (2, 3, 6)


# -- what a topology allows ----------------------------------------------------------------------


def test_expert_layout_tp_is_refused_off_its_topologies():
    check_expert_layout(resolve_topology(2, 1, 1), "tp")  # TP only
    check_expert_layout(resolve_topology(2, 2, 2), "tp")  # overlapping
    check_expert_layout(resolve_topology(2, 2, 4), "ep")
    for tp, ep, world in ((2, 2, 4), (1, 2, 2), (2, 3, 6)):
        with pytest.raises(TopologyError) as e:
            check_expert_layout(resolve_topology(tp, ep, world), "tp")
        assert f"tp_size={tp}, ep_size={ep}, world_size={world}" in str(e.value)
        assert "--moe-expert-layout ep" in str(e.value)
    with pytest.raises(TopologyError, match="unknown MoE expert layout"):
        check_expert_layout(resolve_topology(2, 1, 1), "dp")


def test_attention_heads_that_divide_or_replicate():
    check_attention_heads("LlamaForCausalLM", 32, 8, 1)
    check_attention_heads("LlamaForCausalLM", 32, 8, 4)
    check_attention_heads("LlamaForCausalLM", 32, 8, 8)
    check_attention_heads("LlamaForCausalLM", 32, 2, 8)  # each KV head on 4 ranks
    check_attention_heads("LlamaForCausalLM", 4, 1, 2)
    check_attention_heads("LlamaForCausalLM", 6, 6, 4)  # uneven: 2/2/1/1 (tests/distributed/test_uneven_head_split.py)
    check_attention_heads("LlamaForCausalLM", 12, 6, 4)  # uneven in whole KV groups: KV 2/2/1/1, query 4/4/2/2


@pytest.mark.parametrize("heads, kv_heads, tp, fragment", [
    (6, 2, 4, "6 attention heads cannot be split evenly over tp_size=4, and with fewer KV heads (2) than ranks"),
    (12, 3, 4, "3 KV heads cannot be replicated evenly over tp_size=4"),
    (10, 4, 2, "10 attention heads do not form whole groups over 4 KV heads"),
])
def test_attention_heads_that_do_not_divide_name_the_model_and_sizes(heads, kv_heads, tp, fragment):
    with pytest.raises(TopologyError) as e:
        check_attention_heads("Qwen3ForCausalLM", heads, kv_heads, tp)
    assert str(e.value).startswith("Qwen3ForCausalLM: ")
    assert fragment in str(e.value)


# -- MoE: which group sums the partial outputs, and what each rank holds -------------------------


@pytest.fixture
def distinct_groups():
    """Distinguishable stand-ins for the TP, EP and world groups."""
    parallel_state.init_tensor_parallel(0, 2, "tp")
    parallel_state.init_expert_parallel(0, 2, "ep")
    parallel_state.init_world_group(0, 4, "world")
    yield
    parallel_state.reset_parallel_state()


@pytest.mark.parametrize("tp, ep, world, layout, group", [
    (2, 1, 2, "ep", "tp"),     # TP only: experts sliced over TP
    (2, 1, 2, "tp", "tp"),
    (1, 2, 2, "ep", "ep"),     # EP only: expert ranges over EP
    (2, 2, 2, "ep", "tp"),     # overlapping: the TP group is the EP group is the world
    (2, 2, 2, "tp", "tp"),
    (2, 2, 4, "ep", "world"),  # mesh: ranges by EP rank, sliced by TP rank: every rank's part differs
    (2, 3, 6, "ep", "world"),
])
def test_moe_partial_outputs_are_summed_over_exactly_the_ranks_that_split_them(tp, ep, world, layout, group,
                                                                               distinct_groups):
    assert moe_reduce_group(resolve_topology(tp, ep, world), layout).group == group


def test_moe_layout_of_every_mesh_rank_covers_each_expert_slice_once(distinct_groups):
    """tp x ep = 2 x 2 over 4 ranks: the parts (expert range x intermediate slice) tile the layer."""
    parts = set()
    for rank in range(4):
        layout = moe_layout(resolve_topology(2, 2, 4, rank), "ep")
        experts, inter = layout.expert_range(8), layout.intermediate_slice(32)
        parts.add((experts, inter))
        assert layout.reduce_group.group == "world"
    assert parts == {((0, 4), (0, 16)), ((0, 4), (16, 32)), ((4, 8), (0, 16)), ((4, 8), (16, 32))}


def test_moe_layout_of_overlapping_groups_gives_whole_uneven_expert_ranges(distinct_groups):
    ranges = [moe_layout(resolve_topology(2, 2, 2, r), "ep").expert_range(5) for r in range(2)]
    assert ranges == [(0, 2), (2, 5)]
    slices = [moe_layout(resolve_topology(2, 2, 2, r), "tp").intermediate_slice(32) for r in range(2)]
    assert slices == [(0, 16), (16, 32)]


# -- launch environment --------------------------------------------------------------------------


def test_torchrun_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    parsed = torchrun_env(env)
    assert (parsed.rank, parsed.world_size, parsed.local_rank, parsed.master_addr, parsed.master_port,
            parsed.agent_store) == (3, 4, 1, "10.0.0.1", 29400, True)
    assert torchrun_env({}) is None
    assert torchrun_env(dict(env, WORLD_SIZE="1")) is None  # a single rank is no parallel launch


def test_topology_from_torchrun_environment_and_flags():
    args = SimpleNamespace(tp_size=2, ep_size=2, world_size=1, rank=0)
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    topology, parsed = topology_from_args(args, env)
    assert (topology.rank, topology.tp_rank, topology.ep_rank, topology.world_size) == (3, 1, 1, 4)
    assert parsed.local_rank == 3
    with pytest.raises(TopologyError, match="--world-size 2 disagrees with torchrun's WORLD_SIZE=4"):
        topology_from_args(SimpleNamespace(tp_size=2, ep_size=2, world_size=2, rank=0), env)
    topology, parsed = topology_from_args(SimpleNamespace(tp_size=2, ep_size=1, world_size=1, rank=0), {})
    assert parsed is None and topology.world_size == 2


def test_loopback_addresses():
    assert all(map(is_loopback, ("127.0.0.1", "127.1.2.3", "localhost", "::1")))
    assert not any(map(is_loopback, ("10.0.0.1", "192.168.1.5", "node-0")))


# -- the step message ------------------------------------------------------------------------------


def test_step_message_round_trips_through_msgpack():
    from metrale.distributed.step_channel import step_message
    from metrale.messages.sampling_params import SamplingParams
    from metrale.messages.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=-3, stop=["x"], stop_token_ids=[4],
                            logprobs=2, repetition_penalty=1.1, eos_token_ids=[9])
    plan = SchedulerOutput([NewRequestData("a", [1, 2, 3], 2, params, 2**63 - 1, [0, 1], 0)],
                           [CachedRequestData("b", [7], 33)], {"a": 3, "b": 1}, ["c"], [(1, 5)])
    wire = msgpack.unpackb(msgpack.packb(step_message(4, plan, False, (3, {"b": 12})), use_bin_type=True),
                           raw=False, strict_map_key=False)
    assert wire["type"] == "step" and wire["step"] == 4 and wire["read_first"] is False
    assert wire["sampled"] == [3, {"b": 12}]
    assert SchedulerOutput.from_wire(wire["plan"]) == plan


class _FakeRunner:
    """Launches record their order; each step samples token 100 + step for request "a"."""

    def __init__(self, draws=None):
        self.requests = {"a": SimpleNamespace(token_ids=[1, 2])}
        self.log, self.launched = [], 0
        self.draws = draws or {}

    def execute_async(self, plan):
        step, self.launched = self.launched, self.launched + 1
        self.log.append(f"launch {step}")
        token = self.draws.get(step, 100 + step)
        runner = self

        class Pending:
            def result(self):
                runner.log.append(f"read {step}")
                runner.requests["a"].token_ids.append(token)
                return SimpleNamespace(sampled_token_ids={"a": token})

        return Pending()


def _message(step, read_first, sampled):
    from metrale.distributed.step_channel import step_message
    from metrale.messages.scheduler_output import SchedulerOutput

    return msgpack.unpackb(msgpack.packb(step_message(step, SchedulerOutput([], [], {}, [], []), read_first, sampled),
                                         use_bin_type=True), raw=False, strict_map_key=False)


def test_a_worker_follows_rank_zeros_order_of_launches_and_reads():
    from metrale.distributed.step_channel import StepFollower

    runner = _FakeRunner()
    follower = StepFollower(runner)
    follower.run(_message(0, True, (-1, {})))
    follower.run(_message(1, False, (-1, {})))  # asynchronous: launch 1, then read 0
    follower.run(_message(2, True, (0, {"a": 100})))  # a step that needs real tokens: read 1 first
    assert runner.log == ["launch 0", "launch 1", "read 0", "read 1", "launch 2"]
    assert follower.diverged == 0


def test_a_worker_takes_rank_zeros_tokens_when_nothing_was_built_on_its_own():
    from metrale.distributed.step_channel import StepFollower

    runner = _FakeRunner(draws={0: 7})  # this rank drew 7 where rank 0 drew 100
    follower = StepFollower(runner)
    follower.run(_message(0, True, (-1, {})))
    follower.run(_message(1, True, (0, {"a": 100})))  # synchronous: step 0 was the last launched
    assert runner.requests["a"].token_ids[:3] == [1, 2, 100] and follower.diverged == 1


def test_a_worker_reports_tokens_it_can_no_longer_take_back(caplog):
    from metrale.distributed.step_channel import StepFollower

    runner = _FakeRunner(draws={0: 7})
    follower = StepFollower(runner)
    follower.run(_message(0, True, (-1, {})))
    follower.run(_message(1, False, (-1, {})))
    follower.run(_message(2, False, (0, {"a": 100})))  # step 1 already ran on this rank's 7
    assert follower.diverged == 1 and "asynchronous" in caplog.text
    assert runner.requests["a"].token_ids[2] == 7


def test_workers_adopt_rank_zeros_tokens():
    from metrale.distributed.step_channel import adopt_sampled

    runner = SimpleNamespace(requests={"a": SimpleNamespace(token_ids=[1, 2, 3]),
                                       "b": SimpleNamespace(token_ids=[4, 5])})
    assert adopt_sampled(runner, {"a": 3, "b": 6, "gone": 1}) == 1
    assert runner.requests["a"].token_ids == [1, 2, 3] and runner.requests["b"].token_ids == [4, 6]


# -- the KV pool is the same size on every rank ---------------------------------------------------


class _FakeParallel:
    def __init__(self, others_min: int):
        self.others_min = others_min
        self.topology = SimpleNamespace(world_size=2)

    def agree_min(self, value: int) -> int:
        return min(value, self.others_min)


def _plan():
    from metrale.executor.memory_plan import MemoryPlan

    return MemoryPlan("cpu", 1 << 34, 100 * 1024 + 1000, 1000, 0, False, 64, 16, 64, 1 << 30)


def test_every_rank_takes_the_smallest_kv_pool():
    from metrale.config.engine_args import EngineArgs
    from metrale.startup.memory import fit_kv_blocks_on_every_rank as _fit_kv_blocks_on_every_rank

    plan = _plan()
    _fit_kv_blocks_on_every_rank(plan, EngineArgs(), _FakeParallel(others_min=60))
    assert plan.num_kv_blocks == 60
    assert any("smallest" in note for note in plan.notes)
    plan = _plan()
    _fit_kv_blocks_on_every_rank(plan, EngineArgs(), _FakeParallel(others_min=10**6))
    assert plan.num_kv_blocks == 100


def test_a_rank_that_cannot_fit_stops_every_rank():
    from metrale.config.engine_args import EngineArgs
    from metrale.startup.memory import fit_kv_blocks_on_every_rank as _fit_kv_blocks_on_every_rank
    from metrale.executor.memory_plan import MemoryPlanError

    with pytest.raises(MemoryPlanError, match="another rank's memory plan does not fit"):
        _fit_kv_blocks_on_every_rank(_plan(), EngineArgs(), _FakeParallel(others_min=0))
